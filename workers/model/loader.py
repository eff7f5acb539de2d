"""Build a model from a HF checkpoint directory or a random-init preset.

``load_hf_config(model)`` resolves ``model``: a directory with ``config.json``,
or a preset name (``configs/models/<name>.yaml``). ``load_model`` builds the
architecture in the requested dtype on the device and fills it: from the
directory's ``*.safetensors`` (sharded or not), or, for a preset, with
deterministic random weights drawn from ``seed``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.moe import ExpertShard
from splitserve.workers.model.registry import get_model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
INIT_STD = 0.02


def list_presets() -> list[str]:
    root = resources.files("splitserve.configs") / "models"
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_hf_config(model: str) -> tuple[PretrainedConfig, Path | None]:
    """The HF config of ``model`` and its checkpoint directory (None for a preset)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path)), path
    if model in list_presets():
        text = (resources.files("splitserve.configs") / "models" / f"{model}.yaml").read_text()
        fields = yaml.safe_load(text)
        return AutoConfig.for_model(fields.pop("model_type"), **fields), None
    what = "a directory without config.json" if path.is_dir() else "no such directory"
    raise ValueError(
        f"model {model!r} is {what} and not a preset; give a checkpoint directory "
        f"with config.json or one of the presets: {', '.join(list_presets())}"
    )


def load_model(
    hf_config: PretrainedConfig,
    path: Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    load_format: str = "auto",
    expert_shard: ExpertShard | None = None,
) -> nn.Module:
    """``expert_shard``: an expert-parallel rank's routed experts, the only ones allocated,
    read and loaded (None: all)."""
    model_class = get_model_class(hf_config.architectures)
    with _default_dtype(dtype), torch.device(device):
        model = model_class(hf_config, expert_shard=expert_shard)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif path is None:
        init_random_weights(model, seed)
    else:
        load_checkpoint(model, Path(path))
    return model.requires_grad_(False).eval()


def checkpoint_files(path: Path) -> list[Path]:
    """The shards named by the index when there is one, else every ``*.safetensors``."""
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        if absent := [f.name for f in files if not f.is_file()]:
            raise ValueError(f"{index} names shards that do not exist: {', '.join(absent)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def load_checkpoint(model: nn.Module, path: Path) -> None:
    files = checkpoint_files(path)
    seen: set[str] = set()
    elsewhere: set[str] = set()  # experts other expert-parallel ranks hold: not read

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in tqdm(files, desc=f"Loading {path.name}", unit="shard"):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    seen.add(name)
                    if model.holds_elsewhere(name):
                        elsewhere.add(name)
                        continue
                    yield name, f.get_tensor(name)

    taken = model.load_weights(tensors()) | elsewhere
    if missing := sorted(model.expected_weights() - taken):
        raise ValueError(
            f"checkpoint {path} is missing {len(missing)} weights the model needs: "
            f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}"
        )
    if unexpected := sorted(seen - taken):
        logger.warning(
            "ignored %d tensors of %s that the model has no place for: %s%s",
            len(unexpected),
            path,
            ", ".join(unexpected[:5]),
            ", ..." if len(unexpected) > 5 else "",
        )


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Norms 1, everything else N(0, 0.02); the GLM correction bias small and positive.

    Each tensor draws from its own numpy PCG64 stream keyed by (seed, name): the
    values do not depend on the machine, the device, or the other tensors.
    """
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, tensor in model.weight_tensors().items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        shard = getattr(tensor, "expert_shard", None)  # draw every expert, keep the rank's
        shape = tensor.shape if shard is None else (shard.total, *tensor.shape[1:])
        if id(tensor) in norms:
            values = np.ones(shape, dtype=np.float32)
        elif name.endswith("e_score_correction_bias"):
            values = rng.uniform(0.0, 0.1, shape).astype(np.float32)
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * INIT_STD
        if shard is not None:
            values = values[shard.first : shard.first + shard.count]
        tensor.data.copy_(torch.from_numpy(values))


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Like ``init_random_weights`` but drawn on the weights' device: fast, not portable."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, tensor in model.weight_tensors().items():
        if id(tensor) in norms:
            tensor.data.fill_(1.0)
            continue
        # 32 bits: the CPU generator ignores higher seed bits.
        gen = torch.Generator(tensor.device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        tensor.data.normal_(0.0, INIT_STD, generator=gen)
        if name.endswith("e_score_correction_bias"):
            tensor.data.abs_().clamp_(max=0.1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
