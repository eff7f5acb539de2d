"""The scales of an FP8 KV cache: one float32 for K and one for V, per layer.

An FP8 cache holds ``fp8(x / scale)`` and a reader takes ``float(q) * scale``
(``kernels/kv_store.py``). A scale of 0 is not calibrated yet: the first store
into a layer that writes non-zero rows sets it to ``amax / 448`` on the device,
and from then on it is fixed, so every entry is read back with the scale it was
written with. A checkpoint's scales (``checkpoint_scales``, then ``set``) are fixed
from the start: per-tensor ``k_scale`` / ``v_scale`` of a layer's attention, named
as vLLM reads them (``model.layers.{i}.self_attn.k_scale``, or under ``.attn.`` or
``.k_proj.`` / ``.v_proj.``); a layer without them is calibrated as above.

Across a KV hand-off the pages travel as they are (FP8 bytes) and the sender's
scales travel in the done message (``to_wire``). The receiver ``receive``s them:
a layer it has not calibrated adopts the sender's scale, and the bytes stay
identical; a layer it has calibrated differently (another prefill worker, or a
prompt of its own first) gets the arrived rows requantized to its own scale.

The host reads the device scales (one sync) only until every one is set; after
that ``on_host`` answers from its copy and a store may skip the amax pass
(``calibrated``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.kernels.kv_store import dequantize_fp8, quantize_fp8


class KVScales:
    def __init__(self, num_layers: int, device: torch.device | str):
        self.k = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.v = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self._host: tuple[list[float], list[float]] | None = None  # once every scale is set

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([1], [1])`` float32 views of the layer's K and V scales (stores update them)."""
        return self.k[layer_id : layer_id + 1], self.v[layer_id : layer_id + 1]

    @property
    def calibrated(self) -> bool:
        """Every scale is known to be set (the host has seen it): stores may skip the amax."""
        return self._host is not None

    def on_host(self) -> tuple[list[float], list[float]]:
        """``(k scales, v scales)`` as the device holds them (0: not calibrated); reads the
        device until every scale is set, then answers from the host."""
        if self._host is not None:
            return self._host
        k, v = self.k.tolist(), self.v.tolist()
        if all(s > 0 for s in k + v):
            self._host = (k, v)
        return k, v

    def set(self, k: list[float], v: list[float]) -> None:
        """Fixed scales (a checkpoint's); 0 leaves a layer's to its first store."""
        if len(k) != self.num_layers or len(v) != self.num_layers:
            raise ValueError(
                f"KV scales for {len(k)} / {len(v)} layers, the cache has {self.num_layers}"
            )
        bad = [s for s in k + v if not s >= 0]
        if bad:
            raise ValueError(f"KV scales must be > 0 (or 0: calibrated later), got {bad[:4]}")
        self.k.copy_(torch.tensor(k, dtype=torch.float32))
        self.v.copy_(torch.tensor(v, dtype=torch.float32))
        self._host = (list(k), list(v)) if all(s > 0 for s in k + v) else None

    def to_wire(self) -> list[float]:
        """The K scales then the V scales, for a hand-off's done message."""
        k, v = self.on_host()
        return [*k, *v]

    def receive(
        self,
        wire: list[float],
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slots: torch.Tensor,
    ) -> int:
        """Take a sender's scales (``to_wire``) for the rows that arrived at ``slots`` of
        the first ``len(k_caches)`` layers; returns how many layers were requantized."""
        layers = len(k_caches)
        if len(wire) != 2 * self.num_layers:
            raise ValueError(
                f"the sender's KV scales cover {len(wire) // 2} layers, this cache has "
                f"{self.num_layers}: both workers must serve the same model"
            )
        sent = (wire[: self.num_layers], wire[self.num_layers :])
        own = self.on_host()
        final = tuple([o if o > 0 else s for o, s in zip(own[i], sent[i])] for i in range(2))
        if final != own:
            self.k.copy_(torch.tensor(final[0], dtype=torch.float32))
            self.v.copy_(torch.tensor(final[1], dtype=torch.float32))
            self._host = None
            self.on_host()
        requantized = 0
        slots = slots.to(self.k.device)
        for layer in range(layers):
            moved = False
            for caches, scale_from, scale_to in zip((k_caches, v_caches), sent, final):
                s_from, s_to = scale_from[layer], scale_to[layer]
                if s_from > 0 and s_from != s_to:
                    _requantize(caches[layer], slots, s_from, s_to)
                    moved = True
            requantized += moved
        return requantized


SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.|[kv]_proj\.)?([kv])_scale")


def checkpoint_scales(files: list[Path], num_layers: int) -> tuple[list[float], list[float]]:
    """The K and V scales a checkpoint's shards hold for layers ``0 .. num_layers - 1`` (0
    where it has none). ValueError for a scale that is not one positive number."""
    found = ([0.0] * num_layers, [0.0] * num_layers)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                match = SCALE_NAME.fullmatch(name)
                if match is None or int(match[1]) >= num_layers:
                    continue
                value = f.get_tensor(name)
                if value.numel() != 1 or not value.item() > 0:
                    raise ValueError(
                        f"{file.name}: {name} must be one positive number (a per-tensor FP8 "
                        f"KV scale), got shape {tuple(value.shape)}"
                    )
                found[match[2] == "v"][int(match[1])] = float(value.item())
    return found


def _requantize(cache: torch.Tensor, slots: torch.Tensor, s_from: float, s_to: float) -> None:
    """Rows at ``slots`` written with scale ``s_from``, rewritten for ``s_to``."""
    flat = cache.view(-1, *cache.shape[2:])
    rows = dequantize_fp8(flat[slots], torch.tensor(s_from, device=cache.device))
    flat[slots] = quantize_fp8(rows, torch.tensor(s_to, device=cache.device))
