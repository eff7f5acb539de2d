"""The floors `benchmarks/model_step.py` divides by, counted by hand for a small shape."""

from __future__ import annotations

import pytest

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


def test_step_bench_hands_out_fresh_blocks_and_starts_over_after_reset():
    """Each step gets blocks no earlier step holds; after ``reset_blocks`` (the profiles
    are done) the timed steps start from block 1 again instead of running out."""
    from benchmarks.model_step import StepBench
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.workers.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model="qwen3-tiny",
            device="cpu",
            load_format="dummy",
            cache=CacheConfig(block_size=16, num_kv_blocks=9),
            scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=128),
        )
    )
    try:
        bench = StepBench(engine)
        assert bench.blocks(64) == [1, 2, 3, 4]
        assert bench.blocks(50) == [5, 6, 7, 8]  # 50 tokens: 4 blocks of 16
        with pytest.raises(ValueError, match="too small"):
            bench.blocks(1)
        bench.reset_blocks()
        assert bench.blocks(17) == [1, 2]
        assert engine.kv_cache.k[0][0].abs().sum() == 0  # the null page stays zero
    finally:
        engine.close()
