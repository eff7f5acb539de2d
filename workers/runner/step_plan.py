"""Which fusions a step's layers use, decided once per step: ``StepPlan``.

The layers compute the model (norm, attention, norm, MLP); a few of their kernels
can take the next op in, and whether they do depends on the step's shape, the GPU
and the attention backend, never on the layer. ``plan_step`` decides it once per
step, after the attention backend planned the step, and the plan rides on the
``ForwardBatch`` to every layer:

- a norm's residual add and the norm go into the projection after it (qkv, and a
  gated MLP's gate_up): ``ops.rms_norm_linear``, one kernel for one row;
- a gated MLP's SiLU-and-mul goes into the down projection
  (``ops.silu_and_mul_linear``, one kernel for one row) or, where
  ``ops.activation_in_gate_up`` says (17 to 64 rows on some GPUs), into the gate_up
  projection's epilogue, the add-norm then running alone (``Activation``);
- q/k norm and rotary run inside the attention kernel where the backend's planned
  attention does so (``AttentionKernel.norms_qk``: split-KV decode up to 16
  requests);
- at one row, attention that norms q/k launches as the qkv projection starts
  (programmatic dependent launch, ``qkv_starts_attention``).

A CUDA-graph runner plans the batch of the size it captures, so a replay runs what
that size's eager step would.

Under expert parallelism the plan also carries how the step's MoE layers move tokens
between the ranks (``moe_dispatch``: the mode and capacity every rank of the group
agreed on for this step, ``workers/parallel/lockstep.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.kernels import ops
from splitserve.workers.attention.base import AttentionKernel
from splitserve.workers.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from splitserve.workers.parallel.dispatch import MoEDispatch


class Activation(enum.Enum):
    """Where a gated MLP's SiLU-and-mul runs."""

    # Handed to the down projection (``ops.silu_and_mul_linear``): on its loads at one
    # row, a kernel of its own before it otherwise. The add-norm goes into gate_up.
    WITH_DOWN = "with_down"
    # In the gate_up projection's epilogue (``ops.linear_silu_and_mul``); that kernel
    # cannot take the add-norm too, which runs on its own.
    IN_GATE_UP = "in_gate_up"


@dataclass(frozen=True)
class StepPlan:
    """The fusions of one step (module docstring). ``StepPlan()`` suits any step: it
    takes no fusion that the rows, the GPU or the backend would have to allow."""

    activation: Activation = Activation.WITH_DOWN
    # The backend norms and rotates q and k in its attention kernel (``QKNormRope``).
    attention_norms_qk: bool = False
    # One row, attention norming q/k: in a layer with q/k norm nothing runs between
    # the qkv projection and attention, and the projection lets attention launch as it
    # starts; the attention kernel loads its first KV tile meanwhile (``pdl.py``).
    qkv_starts_attention: bool = False
    # Expert parallelism: the step's dispatch mode and capacity; None: experts all here.
    moe_dispatch: MoEDispatch | None = None


def plan_step(forward_batch: ForwardBatch) -> StepPlan:
    """The plan for a step of ``forward_batch``'s shape, on its device, with its backend's
    attention as planned (``AttentionBackend.kernel``)."""
    fb = forward_batch
    return plan_rows(fb.num_tokens, fb.input_ids.device, fb.attn_backend.kernel(fb))


def plan_rows(
    num_rows: int, device: torch.device, attention: AttentionKernel | None = None
) -> StepPlan:
    """The plan for a step of ``num_rows`` tokens on ``device`` whose attention does what
    ``attention`` says (default: attends only)."""
    attention = attention or AttentionKernel()
    in_gate_up = ops.activation_in_gate_up(num_rows, device)
    return StepPlan(
        activation=Activation.IN_GATE_UP if in_gate_up else Activation.WITH_DOWN,
        attention_norms_qk=attention.norms_qk,
        qkv_starts_attention=attention.norms_qk and num_rows == 1,
    )


def plan_forward(forward_batch: ForwardBatch) -> None:
    """Plan an eager step: the backend's attention, then the step's fusions."""
    forward_batch.attn_backend.plan(forward_batch)
    forward_batch.plan = plan_step(forward_batch)
