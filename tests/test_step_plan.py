"""The step plan (``workers/runner/step_plan.py``): which fusions a step takes, decided
once a step from its rows, its GPU and its attention; and layers given a plan compute
what the unfused reference does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import tuning
from splitserve.kernels.triton import device as gpu
from splitserve.workers.attention.base import AttentionKernel
from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.model.layers.decoder import DecoderLayer, RopeAttention
from splitserve.workers.model.layers.layernorm import AddNorm, RMSNorm
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.model.layers.rotary_embedding import RotaryEmbedding
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch
from splitserve.workers.runner.step_plan import Activation, StepPlan, plan_rows, plan_step

CUDA = torch.device("cuda")  # only named: the plan reads the device's name, nothing runs
NORMS_QK = AttentionKernel(norms_qk=True, reads_batch_index=True)  # split-KV, <= 16 requests


@pytest.fixture
def named_gpu(monkeypatch):
    """Makes ``CUDA`` a GPU of the given name."""

    def name(gpu_name: str) -> None:
        monkeypatch.setattr(gpu, "name", lambda device: gpu_name)

    return name


@pytest.mark.parametrize(
    ("rows", "in_gate_up"),
    [(1, False), (8, False), (16, False), (17, True), (40, True), (64, True), (65, False)]
    + [(4096, False)],  # a prefill
)
def test_the_activation_goes_into_gate_up_for_17_to_64_rows_on_the_table_s_gpus(
    named_gpu, rows, in_gate_up
):
    named_gpu("NVIDIA H100 80GB HBM3")
    want = Activation.IN_GATE_UP if in_gate_up else Activation.WITH_DOWN
    assert plan_rows(rows, CUDA).activation is want
    named_gpu("NVIDIA H200")  # a decode step lost with the 17-64-row kernels there
    assert plan_rows(rows, CUDA).activation is Activation.WITH_DOWN


def test_every_gpu_the_table_does_not_name_takes_the_default(named_gpu):
    named_gpu("NVIDIA A100-SXM4-80GB")
    assert tuning.for_device(CUDA) is tuning.DEFAULT
    assert plan_rows(32, CUDA) == StepPlan()
    assert tuning.for_device(torch.device("cpu")) is tuning.INTERPRETER


@pytest.mark.parametrize("rows", [1, 2, 16, 32])
def test_a_cpu_step_fuses_nothing_the_gpu_would_have_to_allow(rows):
    assert plan_rows(rows, torch.device("cpu")) == StepPlan()


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_attention_starts_with_qkv_only_at_one_row_where_it_norms_q_and_k(named_gpu, rows):
    named_gpu("NVIDIA H100 80GB HBM3")
    fused = plan_rows(rows, CUDA, NORMS_QK)
    assert fused.attention_norms_qk
    assert fused.qkv_starts_attention == (rows == 1)
    apart = plan_rows(rows, CUDA, AttentionKernel())
    assert not apart.attention_norms_qk and not apart.qkv_starts_attention


class NormingBackend(TorchAttentionBackend):
    """The torch backend, applying the layer's q/k norm and rotary itself as a fusing
    backend does (and counting the steps it did so)."""

    def __init__(self) -> None:
        super().__init__()
        self.normed = 0

    def kernel(self, forward_batch) -> AttentionKernel:
        return NORMS_QK

    def forward(self, q, k, v, layer, forward_batch, norm_rope=None):
        assert norm_rope is not None, "the plan hands the q/k norm to attention"
        self.normed += 1
        q, k = norm_rope(q, k)
        return super().forward(q, k, v, layer, forward_batch)


def _step(backend, kv_cache, rows: int = 3):
    """A decode step of ``rows`` requests with 5 tokens of KV each, planned."""
    steps = [StepRequest([7 + i], 5, [1 + i, 5 + i], sample=True) for i in range(rows)]
    return build_forward_batch(steps, kv_cache, backend, "cpu")


def test_an_eager_step_is_planned_with_its_attention():
    cache = KVCache(KVLayout(1, 2, 16, 4, torch.float32), 16, "cpu")
    plain = _step(TorchAttentionBackend(), cache)
    assert plain.plan == plan_step(plain) == StepPlan()
    fused = _step(NormingBackend(), cache, rows=1)
    assert fused.plan == plan_rows(1, torch.device("cpu"), NORMS_QK)
    assert fused.plan.attention_norms_qk and fused.plan.qkv_starts_attention


def _layer(seed: int = 0) -> DecoderLayer:
    torch.manual_seed(seed)
    rope = RotaryEmbedding(16, 16, 64, 1e4 ** -(torch.arange(0, 16, 2) / 16))
    attn = RopeAttention(0, 32, 4, 2, 16, rope, qk_norm=True)
    layer = DecoderLayer(attn, GatedMLP(32, 48), 32, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (1 if p.dim() == 1 else 0))
    return layer


@torch.no_grad()
def test_a_decoder_layer_computes_the_same_under_every_plan():
    """The q/k norm in attention or before it, the SiLU-and-mul with gate_up or down:
    the same outputs and the same KV as the unfused layer."""
    layer = _layer()
    hidden, residual = torch.randn(3, 32), torch.randn(3, 32)
    results = []
    for backend, activation in [
        (TorchAttentionBackend(), Activation.WITH_DOWN),
        (NormingBackend(), Activation.IN_GATE_UP),
    ]:
        cache = KVCache(KVLayout(1, 2, 16, 4, torch.float32), 16, "cpu")
        fb = _step(backend, cache)
        fb.plan = StepPlan(activation, attention_norms_qk=fb.plan.attention_norms_qk)
        out = layer(fb.positions, hidden, residual, fb)
        results.append((*out, cache.k[0].clone(), cache.v[0].clone()))
    assert backend.normed == 1  # the fusing backend was handed the q/k norm
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("activation", list(Activation))
def test_a_gated_mlp_under_either_plan_is_the_reference_mlp(activation):
    norm, mlp = RMSNorm(32), GatedMLP(32, 48)
    for p in (*norm.parameters(), *mlp.parameters()):
        p.copy_(torch.randn_like(p) / 4 + (1 if p.dim() == 1 else 0))
    hidden, residual = torch.randn(5, 32), torch.randn(5, 32)
    out, new_residual = mlp(AddNorm(norm, hidden, residual), StepPlan(activation))
    summed = hidden + residual
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    gate, up = F.linear(normed, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
