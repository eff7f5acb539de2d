"""Layers on CUDA (Triton kernels) against the float32 torch reference; CUDA-graph capture.

Each layer is built on the GPU in the test dtype; its reference is a float32
copy on the CPU (the same rounded weights), fed the same inputs. Errors are
``|out - ref| / |ref|`` over the whole output. MoE routing is compared in
float32 only: in bf16 the router logits themselves round, and a near tie may
then pick another expert, which is a fair result and not a kernel error. The
capture tests record a forward in a ``torch.cuda.CUDAGraph``, replay it on new
inputs copied into the static input and compare with eager calls.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from splitserve.kernels import ops
from splitserve.kernels.moe_routing import softmax_topk as reference_softmax_topk
from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.model.layers.moe import Experts, GroupedTopKRouter, MoEBlock, SoftmaxRouter
from splitserve.workers.model.layers.rotary_embedding import get_rope
from splitserve.workers.runner.step_plan import StepPlan, plan_rows
from tests.kernels.utils import prefill_then_decode, prompts, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}
HIDDEN, NUM_EXPERTS, TOP_K = 256, 16, 4
TOKENS = [1, 7, 300]  # one decode row, a few, a prefill


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), "NaN in the output"
    return float((out - ref).norm() / ref.norm())


def on_gpu(factory, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``factory()`` built as the loader builds models (default dtype, CUDA), random weights."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            module = factory()
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(seed)
    for name, t in module.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            values = torch.rand(t.shape, generator=g) * 0.3
        elif "norm" in name or isinstance(module, RMSNorm):
            values = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            values = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        t.copy_(values)
    return module.eval()


def reference(module: torch.nn.Module) -> torch.nn.Module:
    """A float32 CPU copy: runs the torch reference kernels on the same (rounded) weights."""
    return copy.deepcopy(module).to("cpu", torch.float32)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def cpu32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float().cpu() for t in tensors]


def plan(x: torch.Tensor) -> StepPlan:
    """The plan of a step of ``x``'s rows on its device, as the runner makes it."""
    return plan_rows(x.shape[0], x.device)


# ---- each layer against the float32 reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(33, HIDDEN), (33, 4, 128)])  # hidden states; q/k norm
@torch.no_grad()
def test_rms_norm(shape, dtype):
    norm = on_gpu(lambda: RMSNorm(shape[-1], 1e-6), dtype)
    ref = reference(norm)
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    out = norm(x)
    assert out.dtype == dtype and rel_err(out, ref(*cpu32(x))) <= TOL[dtype]
    out, new_residual = norm(x, residual)
    ref_out, ref_residual = ref(*cpu32(x, residual))
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert rel_err(new_residual, ref_residual) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partial", [1.0, 0.5])  # 0.5: GLM-4.5
@torch.no_grad()
def test_rotary_embedding(partial, dtype):
    head_dim, heads, kv_heads, num_tokens = 128, 8, 2, 57
    config = SimpleNamespace(
        rope_theta=1e6, partial_rotary_factor=partial, max_position_embeddings=8192
    )
    rope = on_gpu(lambda: get_rope(config, head_dim), dtype)
    assert rope.cos.dtype == torch.float32
    ref = reference(rope)
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)  # strided views
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    got_q, got_k = rope(positions, q, k)
    want_q, want_k = ref(positions.cpu(), *cpu32(q, k))
    assert rel_err(got_q, want_q) <= TOL[dtype] and rel_err(got_k, want_k) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKENS)
@torch.no_grad()
def test_gated_mlp(num_tokens, dtype):
    mlp = on_gpu(lambda: GatedMLP(HIDDEN, 512), dtype)
    x = randn(num_tokens, HIDDEN, dtype=dtype)
    (x_ref,) = cpu32(x)
    got, want = mlp.on_normed(x, plan(x)), reference(mlp).on_normed(x_ref, plan(x_ref))
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKENS)
@torch.no_grad()
def test_experts(num_tokens, dtype):
    """Routed experts with fixed routing (the routing of every dtype is the same)."""
    experts = on_gpu(lambda: Experts(NUM_EXPERTS, HIDDEN, 96), dtype)
    x = randn(num_tokens, HIDDEN, dtype=dtype)
    weights, ids = reference_softmax_topk(torch.randn(num_tokens, NUM_EXPERTS), TOP_K, True)
    out = experts(x, weights.to("cuda"), ids.to("cuda"))
    assert out.dtype == dtype
    assert rel_err(out, reference(experts)(*cpu32(x), weights, ids)) <= TOL[dtype]


def softmax_router() -> torch.nn.Module:
    return SoftmaxRouter(HIDDEN, NUM_EXPERTS, TOP_K, renormalize=True)


def grouped_router() -> torch.nn.Module:
    return GroupedTopKRouter(HIDDEN, NUM_EXPERTS, TOP_K, 4, 2, True, 2.5)


def moe_block(router, shared: int) -> torch.nn.Module:
    return MoEBlock(router(), NUM_EXPERTS, HIDDEN, 96, shared)


MOE_KINDS = {
    "softmax": lambda: moe_block(softmax_router, 0),
    "grouped": lambda: moe_block(grouped_router, 64),
    "grouped-no-bias": lambda: moe_block(grouped_router, 64),
}


def build_moe(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    block = on_gpu(MOE_KINDS[kind], dtype)
    if kind == "grouped-no-bias":
        block.gate.e_score_correction_bias = None  # what the loader does without the tensor
    return block


@pytest.mark.parametrize("kind", list(MOE_KINDS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@torch.no_grad()
def test_router_and_moe_block_float32(kind, num_tokens):
    block = build_moe(kind, torch.float32)
    ref = reference(block)
    x = randn(num_tokens, HIDDEN, dtype=torch.float32)
    weights, ids = block.gate(x)
    ref_weights, ref_ids = ref.gate(*cpu32(x))
    # same experts (the reference may order the grouped top-k differently), same weights
    order, ref_order = ids.argsort(-1).cpu(), ref_ids.argsort(-1)
    assert torch.equal(ids.cpu().gather(1, order), ref_ids.gather(1, ref_order))
    assert rel_err(weights.cpu().gather(1, order), ref_weights.gather(1, ref_order)) <= 1e-5
    (x_ref,) = cpu32(x)
    got, want = block.on_normed(x, plan(x)), ref.on_normed(x_ref, plan(x_ref))
    assert rel_err(got, want) <= TOL[torch.float32]


# ---- whole tiny models


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"])
def test_tiny_model_float32(preset):
    """Triton path on the GPU against the reference on the CPU, prefill then decode."""
    batch = prompts()
    got = prefill_then_decode(tiny_model(preset, torch.float32, "cuda"), batch)
    want = prefill_then_decode(tiny_model(preset, torch.float32, "cpu"), batch)
    assert rel_err(got, want) <= TOL[torch.float32]


def test_tiny_dense_model_bf16_against_float32():
    """bf16 weights on the GPU against the same weights in float32 on the CPU."""
    model = tiny_model("qwen3-tiny", torch.bfloat16, "cuda")
    batch = prompts()
    assert (
        rel_err(prefill_then_decode(model, batch), prefill_then_decode(reference(model), batch))
        <= 2e-2
    )


class RoutingPin:
    """Records every router decision of one run of a model and replays them in the next.

    In half precision a kernel that rounds one value differently upstream can flip a
    router's near-tie and swap an expert, which changes the logits by far more than
    rounding. Pinning the routing keeps a comparison of two kernel sets to rounding;
    the routers themselves are compared on their own above.
    """

    def __init__(self, model: torch.nn.Module, monkeypatch):
        self.decisions: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replaying, self.next = False, 0
        for block in model.modules():
            if isinstance(block, MoEBlock):
                monkeypatch.setattr(block.gate, "forward", self._pinned(block.gate.forward))

    def _pinned(self, route):
        def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.replaying:
                self.decisions.append(route(x))
                return self.decisions[-1]
            self.next += 1
            return self.decisions[self.next - 1]

        return forward

    def replay(self) -> None:
        self.replaying, self.next = True, 0

    def all_replayed(self) -> bool:
        return self.next == len(self.decisions)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"])
def test_tiny_model_triton_against_torch_same_dtype(preset, dtype, monkeypatch):
    """Same GPU, same dtype, the reference kernels on CUDA, the same routing
    (``RoutingPin``): the outputs differ by kernel rounding only."""
    model, batch = tiny_model(preset, dtype, "cuda"), prompts()
    pin = RoutingPin(model, monkeypatch)
    got = prefill_then_decode(model, batch)
    pin.replay()
    monkeypatch.setattr(ops, "use_triton", lambda x: False)
    want = prefill_then_decode(model, batch)
    assert pin.all_replayed()
    assert rel_err(got, want) <= TOL[dtype]


# ---- CUDA-graph capture


def capture(fn, *static_inputs: torch.Tensor):
    """Warm ``fn`` up on a side stream (Triton compiles outside the capture), then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static_inputs)
    return graph, static_out


@pytest.mark.parametrize("kind", list(MOE_KINDS))
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
@torch.no_grad()
def test_moe_block_cuda_graph_replays_new_inputs(kind, num_tokens):
    block = build_moe(kind, torch.bfloat16)
    static_x = randn(num_tokens, HIDDEN, dtype=torch.bfloat16)
    step = plan(static_x)
    graph, static_out = capture(lambda x: block.on_normed(x, step), static_x)
    previous = None
    for _ in range(3):
        x = randn(num_tokens, HIDDEN, dtype=torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        eager = block.on_normed(x, step)
        assert rel_err(static_out, eager) <= 1e-3
        if previous is not None:
            assert not torch.equal(static_out, previous)  # the replay saw the new input
        previous = static_out.clone()


@torch.no_grad()
def test_dense_layers_cuda_graph_replays_new_inputs():
    """Fused add-norm, partial rotary and the gated MLP in one captured piece."""
    dtype, num_tokens, head_dim = torch.bfloat16, 16, 64
    norm = on_gpu(lambda: RMSNorm(HIDDEN, 1e-6), dtype)
    mlp = on_gpu(lambda: GatedMLP(HIDDEN, 512), dtype)
    config = SimpleNamespace(rope_theta=1e4, partial_rotary_factor=0.5, max_position_embeddings=512)
    rope = on_gpu(lambda: get_rope(config, head_dim), dtype)

    def piece(x, residual, positions, q, k):
        hidden, residual = norm(x, residual)
        q, k = rope(positions, q, k)
        return mlp.on_normed(hidden, plan(hidden)), residual, q, k

    def inputs():
        return (
            randn(num_tokens, HIDDEN, dtype=dtype),
            randn(num_tokens, HIDDEN, dtype=dtype),
            torch.randint(0, 512, (num_tokens,), device="cuda"),
            randn(num_tokens, 4, head_dim, dtype=dtype),
            randn(num_tokens, 2, head_dim, dtype=dtype),
        )

    static = inputs()
    graph, static_out = capture(piece, *static)
    for _ in range(2):
        new = inputs()
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        for got, want in zip(static_out, piece(*new)):
            assert rel_err(got, want) <= 1e-3
