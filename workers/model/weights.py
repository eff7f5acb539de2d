"""Checkpoint tensor names <-> the model's fused parameters.

A checkpoint stores q/k/v, gate/up and every expert's projections as separate
tensors; the model fuses them into one parameter each and fills it shard by
shard through the parameter's ``weight_loader``. Both directions live here so
the loader can name a missing checkpoint tensor exactly.
"""

from __future__ import annotations

import re

import torch

# (checkpoint fragment, parameter fragment, shard id)
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_ALL_EXPERTS = re.compile(
    r"\.experts\.(gate_up_proj|down_proj)$"
)  # transformers 5 in-memory layout
_EXPERT_SHARD = {"gate": "w1", "up": "w3", "down": "w2"}

Shard = str | int | tuple[str, int | None] | None


def param_target(name: str) -> tuple[str, Shard]:
    """The parameter a checkpoint tensor fills, and which shard of it (None: all of it)."""
    if m := _PER_EXPERT.search(name):
        shard = _EXPERT_SHARD[m[2]]
        param = "w2_weight" if shard == "w2" else "w13_weight"
        return f"{name[: m.start()]}.experts.{param}", (shard, int(m[1]))
    if m := _ALL_EXPERTS.search(name):
        shard = "w13" if m[1] == "gate_up_proj" else "w2"
        return f"{name[: m.start()]}.experts.{shard}_weight", (shard, None)
    for ckpt, ours, shard in STACKED:
        if ckpt in name:
            return name.replace(ckpt, ours), shard
    return name, None


def checkpoint_names(param_name: str, param: torch.Tensor) -> list[str]:
    """The per-tensor checkpoint names (published HF layout) that fill a parameter."""
    for suffix, parts in (
        (".experts.w13_weight", ("gate", "up")),
        (".experts.w2_weight", ("down",)),
    ):
        if param_name.endswith(suffix):
            prefix = param_name[: -len(suffix)]
            shard = getattr(param, "expert_shard", None)  # expert parallelism: a rank's experts
            experts = shard.ids if shard is not None else range(param.shape[0])
            return [f"{prefix}.experts.{e}.{p}_proj.weight" for e in experts for p in parts]
    for ours in (".qkv_proj.", ".gate_up_proj."):
        if ours in param_name:
            return [param_name.replace(ours, c) for c, o, _ in STACKED if o == ours]
    return [param_name]
