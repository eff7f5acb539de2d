"""Tiny random HF checkpoints for tests, written by transformers' own ``save_pretrained``.

Every writer returns the directory, which then holds config.json, the
``*.safetensors`` shard(s), generation_config.json and the tiny tokenizer
(vocab 512, eos ``<|endoftext|>`` = 0). Weights are drawn so that logits are
not flat: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), biases nonzero,
and the LM head wide enough (std 0.35) that top-1/top-2 gaps are clear.

``load_reference(dir)`` loads a checkpoint back into transformers (eager
attention, float32) and fails if transformers misses any weight.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from splitserve.workers.model.tokenizer import save_tiny_tokenizer

VOCAB_SIZE = 512
INDEX_FILE = "model.safetensors.index.json"
BIAS = "e_score_correction_bias"

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)


def qwen3_config(tie_word_embeddings: bool = False, head_dim: int = 16) -> PretrainedConfig:
    """``head_dim=128``: a size FlashInfer's kernels are built for (GPU tests)."""
    return AutoConfig.for_model(
        "qwen3",
        **{**_COMMON, "head_dim": head_dim},
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=1e6,
        architectures=["Qwen3ForCausalLM"],
    )


def llama_config() -> PretrainedConfig:
    return AutoConfig.for_model(
        "llama",
        **_COMMON,
        tie_word_embeddings=False,
        attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )


def qwen3_moe_config() -> PretrainedConfig:
    return AutoConfig.for_model(
        "qwen3_moe",
        **_COMMON,
        tie_word_embeddings=False,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        architectures=["Qwen3MoeForCausalLM"],
    )


def glm4_moe_config() -> PretrainedConfig:
    fields = dict(_COMMON, head_dim=32)
    return AutoConfig.for_model(
        "glm4_moe",
        **fields,
        tie_word_embeddings=False,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=1,
        architectures=["Glm4MoeForCausalLM"],
    )


def write_qwen3(
    directory: str | Path,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    head_dim: int = 16,
    seed: int = 1,
) -> Path:
    config = qwen3_config(tie_word_embeddings, head_dim)
    return _write(config, directory, seed=seed, max_shard_size=max_shard_size)


def write_qwen3_sharded(directory: str | Path, with_index: bool = True) -> Path:
    """Several shards; ``with_index=False`` deletes model.safetensors.index.json."""
    path = write_qwen3(directory, max_shard_size="60KB")
    if not with_index:
        (path / INDEX_FILE).unlink()
    return path


def write_llama(directory: str | Path) -> Path:
    return _write(llama_config(), directory, seed=2)


def write_qwen3_moe(directory: str | Path) -> Path:
    return _write(qwen3_moe_config(), directory, seed=3)


def write_glm4_moe(directory: str | Path, with_correction_bias: bool = True) -> Path:
    """GLM-4.5 layout, plus the MTP layer at ``model.layers.{N}`` as an extra shard.

    ``with_correction_bias=False`` removes every ``e_score_correction_bias``
    from the files (transformers then initializes it to zeros: plain scores).
    """
    config = glm4_moe_config()
    path = _write(config, directory, seed=4)
    append_shard(path, "model-mtp.safetensors", mtp_layer_tensors(config, seed=5))
    if not with_correction_bias:
        drop_tensors(path, lambda name: name.endswith(BIAS))
    return path


def mtp_layer_tensors(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """A GLM-4.5 MTP layer in the published layout (per-expert tensors)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    n, h = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(seed)
    layer = Glm4MoeDecoderLayer(config, layer_idx=n)
    extra = torch.nn.ModuleDict(
        {
            "enorm": torch.nn.LayerNorm(h, bias=False),
            "hnorm": torch.nn.LayerNorm(h, bias=False),
            "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
            "shared_head": torch.nn.ModuleDict(
                {
                    "norm": torch.nn.LayerNorm(h, bias=False),
                    "head": torch.nn.Linear(h, config.vocab_size, bias=False),
                }
            ),
            "embed_tokens": torch.nn.Embedding(config.vocab_size, h),
        }
    )
    tensors = {**_randomized(layer, seed), **_randomized(extra, seed + 1)}
    for stacked in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        weight = tensors.pop(stacked)
        for e in range(weight.shape[0]):
            if stacked.endswith("gate_up_proj"):
                gate, up = weight[e].chunk(2, dim=0)
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate
                tensors[f"mlp.experts.{e}.up_proj.weight"] = up
            else:
                tensors[f"mlp.experts.{e}.down_proj.weight"] = weight[e]
    return {f"model.layers.{n}.{k}": v.contiguous() for k, v in tensors.items()}


def load_reference(path: str | Path) -> torch.nn.Module:
    """transformers' model of a checkpoint (eager attention, float32); all weights present.

    transformers needs the index to read several shards; for a checkpoint whose
    index was deleted, it reads a linked copy with the index rebuilt.
    """
    path = Path(path)
    if not (path / INDEX_FILE).is_file() and not (path / "model.safetensors").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            for file in path.iterdir():
                (Path(tmp) / file.name).symlink_to(file.resolve())
            weight_map = {}
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(file, framework="pt") as f:
                    weight_map.update({k: file.name for k in f.keys()})  # noqa: SIM118
            _write_index(Path(tmp), {"weight_map": weight_map})
            return load_reference(tmp)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if not k.endswith(BIAS)]
    assert not missing and not info["mismatched_keys"], info
    return model.eval()


def read_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint directory, wherever its shard is."""
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                return f.get_tensor(name)
    raise KeyError(f"{name} is in no shard of {path}")


def append_shard(path: str | Path, file_name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one more shard and register it in the index (created if needed)."""
    path = Path(path)
    index = _index(path)
    save_file(tensors, str(path / file_name), metadata={"format": "pt"})
    index["weight_map"].update({name: file_name for name in tensors})
    _write_index(path, index)


def drop_tensors(path: str | Path, drop: Callable[[str], bool]) -> None:
    """Remove every tensor whose name ``drop`` accepts from the shards (and the index)."""
    path = Path(path)
    index = _index(path)
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(path / file, framework="pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if not drop(k)}  # noqa: SIM118
        save_file(kept, str(path / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not drop(k)}
    _write_index(path, index)


# ---- internals


def _write(
    config: PretrainedConfig, directory: str | Path, seed: int, max_shard_size: str | None = None
) -> Path:
    path = Path(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_randomized(model, seed), strict=False)  # tied lm_head: left out
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    save_tiny_tokenizer(path)
    return path


def _randomized(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values for every tensor of ``module.state_dict()`` (tied ones once)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        randn = torch.randn(t.shape, generator=g)
        if name.endswith(BIAS):
            value = torch.rand(t.shape, generator=g) * 0.3
        elif "norm" in name:
            value = 1.0 + 0.1 * randn
        elif name.endswith("bias"):
            value = 0.1 * randn
        elif "embed_tokens" in name or "head" in name:
            value = 0.35 * randn
        else:  # [..., out, in] projections: unit-scale outputs
            value = randn / t.shape[-1] ** 0.5
        out[name] = value
    return out


def _index(path: Path) -> dict:
    index_file = path / INDEX_FILE
    if index_file.is_file():
        return json.loads(index_file.read_text())
    single = path / "model.safetensors"
    with safe_open(single, framework="pt") as f:
        return {"metadata": {}, "weight_map": {k: single.name for k in f.keys()}}  # noqa: SIM118


def _write_index(path: Path, index: dict) -> None:
    total = 0
    for file in set(index["weight_map"].values()):
        with safe_open(path / file, framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    index["metadata"] = {**index.get("metadata", {}), "total_size": total}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
