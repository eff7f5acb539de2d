"""The floors `benchmarks/model_step.py` divides by, counted by hand for a small shape."""

from __future__ import annotations

from benchmarks.model_step import Shape


def test_kv_bytes_and_prefill_flops():
    shape = Shape(
        layers=2,
        hidden=8,
        heads=4,
        kv_heads=2,
        head_dim=2,
        vocab=10,
        weight_bytes=0,
        linear_params=100,
    )
    assert shape.kv_bytes(tokens=3) == 2 * 2 * 2 * 2 * 2 * 3  # K and V, layers, heads, dim, bf16
    # 3 tokens: 2*100*3 matmul FLOPs; causal pairs 6 -> 4 * 6 * 4 heads * 2 dim * 2 layers;
    # the LM head of the last token: 2 * 10 * 8.
    assert shape.prefill_flops(3) == 2 * 100 * 3 + 4 * 6 * 4 * 2 * 2 + 2 * 10 * 8
