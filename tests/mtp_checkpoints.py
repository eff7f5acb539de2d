"""Tiny GLM-4.5 checkpoints whose MTP layer agrees with the target as much as a test asks.

Built from ``write_glm4_moe`` (transformers' own files), then edited:

- the target: every attention output projection and MLP down projection is scaled
  by ``context_scale``. At 0 the residual stream is the token's embedding, so the
  target's next token is a fixed function of the current one,
  ``f(x) = argmax(lm_head(norm(embed(x))))``; attention still computes and stores
  its KV. Above 0 the context moves the prediction away from ``f`` now and then.
- the MTP layer: its attention and MLP outputs are zero and ``eh_proj = [I, 0]``,
  so it reads only the embedding of the token after its position; with the
  target's embedding, final norm (``shared_head.norm``) and LM head it predicts
  ``f`` of that token: the target's next token when ``context_scale`` is 0.
- ``swapped_pairs``: the MTP head's rows of tokens ``(2i, 2i + 1)``, ``i <
  swapped_pairs``, trade places, so its draft is right exactly when the target's
  token is not one of them: a known fraction of the drafts is accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.checkpoints import write_glm4_moe


def write_glm4_moe_drafter(
    directory: str | Path, context_scale: float = 0.0, swapped_pairs: int = 0
) -> Path:
    path = write_glm4_moe(directory)
    tensors = {}
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors[file] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    every = {k: v for shard in tensors.values() for k, v in shard.items()}
    mtp = f"model.layers.{_num_layers(every)}."
    for shard in tensors.values():
        for name, value in shard.items():
            shard[name] = _edit(name, value, every, mtp, context_scale, swapped_pairs)
    for file, shard in tensors.items():
        save_file(shard, str(file), metadata={"format": "pt"})
    return path


def swapped_tokens(swapped_pairs: int) -> set[int]:
    """The token ids whose MTP head rows trade places."""
    return set(range(2 * swapped_pairs))


def _num_layers(tensors: dict[str, torch.Tensor]) -> int:
    return max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))


def _edit(
    name: str,
    value: torch.Tensor,
    every: dict[str, torch.Tensor],
    mtp: str,
    context_scale: float,
    swapped_pairs: int,
) -> torch.Tensor:
    projects_out = name.endswith("o_proj.weight") or "down_proj" in name
    if not name.startswith(mtp):
        return value * context_scale if projects_out else value
    local = name.removeprefix(mtp)
    if projects_out:
        return torch.zeros_like(value)
    if local == "eh_proj.weight":
        h = value.shape[0]
        return torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    if local == "enorm.weight":
        return torch.ones_like(value)
    if local == "embed_tokens.weight":
        return every["model.embed_tokens.weight"].clone()
    if local == "shared_head.norm.weight":
        return every["model.norm.weight"].clone()
    if local == "shared_head.head.weight":
        head = every["lm_head.weight"].clone()
        order = torch.arange(head.shape[0])
        for t in range(0, 2 * swapped_pairs, 2):
            order[t], order[t + 1] = t + 1, t
        return head[order]
    return value
