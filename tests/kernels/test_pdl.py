"""Programmatic dependent launch (``kernels/triton/pdl.py``).

On the GPU a decode layer's chain of kernels, as the model runs it at one row
(one-row linears with the add-norm or SiLU-and-mul fused in, q/k norm with
rotary on its own or inside split-KV attention, and the attention's merge), runs
with PDL on and off, eagerly and
replayed from a CUDA graph: every result must be bitwise the same, since each
kernel waits for the one before it before it reads anything. A kernel that read
its input before the previous kernel finished writing it would change the
results (the residual is read two or more launches after it is written, the
attention reads the KV row stored in the same launch chain).
"""

import pytest
import torch

from splitserve.kernels.triton import pdl
from tests.kernels.utils import ON_GPU

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 1024, 16, 4, 128, 6144
BLOCK_SIZE, CONTEXT, LAYERS = 16, 300, 3


@pytest.fixture
def pdl_switch():
    """Turns PDL on or off for the test, and back on after it."""
    yield pdl.set_enabled
    pdl.set_enabled(True)


def test_the_switch_is_a_defined_setting():
    """``SPLITSERVE_PDL`` is read through ``splitserve.config.env``: defined once, on by
    default."""
    from splitserve.config import ENV_VARS

    assert ENV_VARS["SPLITSERVE_PDL"][1] == "1"


FLAGS = [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]


@pytest.mark.parametrize("starts_early,lets_next_start,after_loop", FLAGS)
def test_off_on_the_cpu_and_when_disabled(pdl_switch, starts_early, lets_next_start, after_loop):
    flags = {
        "starts_early": starts_early, "lets_next_start": lets_next_start, "after_loop": after_loop
    }  # fmt: skip
    assert pdl.launch_options(torch.device("cpu"), **flags) == {"PDL": 0}
    pdl_switch(False)
    assert not pdl.enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0), **flags) == {"PDL": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("starts_early,lets_next_start,after_loop", FLAGS)
def test_flags_on_the_gpu(starts_early, lets_next_start, after_loop):
    options = pdl.launch_options(
        torch.device("cuda"),
        starts_early=starts_early,
        lets_next_start=lets_next_start,
        after_loop=after_loop,
    )
    if torch.cuda.get_device_capability() < (9, 0):
        assert options == {"PDL": 0}
        return
    want = starts_early * pdl.WAIT + lets_next_start * pdl.LAUNCH_NEXT + after_loop * pdl.AFTER_LOOP
    assert options["PDL"] == want
    assert options.get("launch_pdl", False) == starts_early


def test_long_kernels_let_the_next_launch_after_their_loop(monkeypatch):
    """The linears, and split-KV attention up to ``PDL_MAX_BATCH`` requests, ask for
    ``after_loop`` (a linear asked for ``next_starts_at_once``: the next launches at its
    start); the merge lets the next kernel launch at its start."""
    from splitserve.kernels.triton import decode_attention as attention
    from splitserve.kernels.triton import linear

    asked = []

    def recording(device, **flags):
        asked.append(flags)
        return pdl.launch_options(device, **flags)

    for module in (linear, attention):
        monkeypatch.setattr(module, "launch_options", recording)
    dev = "cuda" if ON_GPU else "cpu"
    x, w = torch.randn(1, 64, device=dev), torch.randn(32, 64, device=dev)
    linear.small_m_linear(x, w)
    assert asked == [{"starts_early": True, "lets_next_start": False, "after_loop": True}]
    asked.clear()  # the one-row qkv projection before split-KV attention (decoder.py)
    linear.small_m_linear(x, w, next_starts_at_once=True)
    assert asked == [{"starts_early": True, "lets_next_start": True, "after_loop": False}]
    for batch, early in ((2, True), (attention.PDL_MAX_BATCH + 1, False)):
        asked.clear()
        q = torch.randn(batch, 4, 16, device=dev)
        cache = torch.randn(4, 4, 2, 16, device=dev)
        tables = torch.ones(batch, 1, dtype=torch.int32, device=dev)
        lens = torch.full((batch,), 3, dtype=torch.int32, device=dev)
        attention.decode_attention(q, cache, cache, tables, lens, 0.25, splits=2)
        assert asked == [
            {"starts_early": early, "lets_next_start": False, "after_loop": early},
            {"starts_early": early, "lets_next_start": True},
        ]


def _weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(*shape, scale=None):
        t = torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)
        return t.to("cuda", torch.bfloat16)

    qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "ln1": 1 + w(HIDDEN, scale=0.1),
        "ln2": 1 + w(HIDDEN, scale=0.1),
        "qkv": w(qkv_out, HIDDEN),
        "q_norm": 1 + w(HEAD_DIM, scale=0.1),
        "k_norm": 1 + w(HEAD_DIM, scale=0.1),
        "o": w(HIDDEN, HEADS * HEAD_DIM),
        "gate_up": w(2 * FFN, HIDDEN),
        "down": w(HIDDEN, FFN),
    }


def _decode_layers(
    x, residual, weights, caches, cos, sin, positions, tables, lens, slots, fused_norm_rope
):
    """``LAYERS`` decoder layers of one decode step, through the ops the model calls (with
    ``fused_norm_rope``, q/k norm and rotary inside split-KV attention, as up to 16 requests)."""
    from splitserve.kernels import ops
    from splitserve.kernels.triton.decode_attention import decode_attention

    for k_cache, v_cache in caches:
        qkv, residual = ops.rms_norm_linear(
            x, residual, weights["ln1"], 1e-6, weights["qkv"], next_starts_at_once=fused_norm_rope
        )  # as DecoderLayer: attention launches at once and loads its first KV tile
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = q.view(-1, HEADS, HEAD_DIM)
        k, v = k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
        norm_rope = (positions, weights["q_norm"], weights["k_norm"], 1e-6, cos, sin)
        if not fused_norm_rope:
            q, k = ops.qk_norm_rope(positions, q, k, *norm_rope[1:])
        attn = decode_attention(
            q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, new_kv=(k, v, slots),
            norm_rope=norm_rope if fused_norm_rope else None,
        )  # fmt: skip
        x = ops.linear(attn.view(-1, HEADS * HEAD_DIM), weights["o"])
        gate_up, residual = ops.rms_norm_linear(
            x, residual, weights["ln2"], 1e-6, weights["gate_up"]
        )
        x = ops.silu_and_mul_linear(gate_up, weights["down"])
    return x, residual


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.skipif(
    ON_GPU and torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm90+"
)
@pytest.mark.parametrize("fused_norm_rope", [False, True])
def test_decode_chain_same_with_and_without_pdl(pdl_switch, fused_norm_rope):
    gen = torch.Generator().manual_seed(0)
    weights = _weights(gen)
    blocks = CONTEXT // BLOCK_SIZE + 2
    shape = (blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # page 0: the null page
    fresh = [
        tuple(torch.randn(shape, generator=gen).to("cuda", torch.bfloat16) for _ in "kv")
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(blocks, generator=gen)[None].add(1).to("cuda", torch.int32)
    lens = torch.tensor([CONTEXT], device="cuda", dtype=torch.int32)
    block, offset = (CONTEXT - 1) // BLOCK_SIZE, (CONTEXT - 1) % BLOCK_SIZE
    slots = (tables[:, block].long() * BLOCK_SIZE + offset).contiguous()
    positions = torch.tensor([CONTEXT - 1], device="cuda")
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * torch.rand(HEAD_DIM // 2)
    cos, sin = (f(torch.cat([angles, angles], -1)).cuda() for f in (torch.cos, torch.sin))
    x0 = torch.randn(1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    r0 = torch.randn(1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)

    def run(enabled: bool, graph: bool):
        pdl_switch(enabled)
        caches = [(k.clone(), v.clone()) for k, v in fresh]
        args = (weights, caches, cos, sin, positions, tables, lens, slots, fused_norm_rope)
        x, r = x0.clone(), r0.clone()
        if not graph:
            out = _decode_layers(x, r, *args)
            return [*out, *(t for kv in caches for t in kv)]
        _decode_layers(x, r, *args)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _decode_layers(x, r, *args)
        for (k_cache, v_cache), (k, v) in zip(caches, fresh, strict=True):
            k_cache.copy_(k)  # the warm-up stored the new rows: start again
            v_cache.copy_(v)
        x.copy_(x0)
        r.copy_(r0)
        g.replay()
        return [*out, *(t for kv in caches for t in kv)]

    expected = run(False, graph=False)
    for enabled, graph in [(True, False), (True, True), (False, True)]:
        got = run(enabled, graph)
        torch.cuda.synchronize()
        names = ["hidden", "residual"] + [f"cache {i}" for i in range(2 * LAYERS)]
        for name, a, b in zip(names, got, expected, strict=True):
            assert torch.equal(a, b), f"{name} differs (pdl={enabled}, graph={graph})"
