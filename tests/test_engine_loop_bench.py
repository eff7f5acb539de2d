"""`benchmarks/engine_loop.py`'s decode loop keeps its batch whole while it times it."""

from __future__ import annotations

from benchmarks.engine_loop import WARMUP_STEPS, LoopBench
from benchmarks.model_step import CONTEXT
from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.workers.engine.llm_engine import LLMEngine


def test_decode_times_the_whole_batch_and_counts_its_contexts():
    """Prompts prefilled in 8 chunks: the first requests are up to 8 tokens ahead. None
    may end during the timed steps (the loop raises if one does), and the mean context
    counts the tokens each request really has."""
    batch, steps = 4, 5
    engine = LLMEngine(
        EngineConfig(
            model="qwen3-tiny",
            device="cpu",
            load_format="dummy",
            cache=CacheConfig(block_size=16, num_kv_blocks=batch * 70 + 1),
            scheduler=SchedulerConfig(
                max_num_seqs=batch, max_num_batched_tokens=512, max_model_len=2048
            ),
        )
    )
    wall, host, context = LoopBench(engine).decode(batch, steps)
    assert wall > 0 and host > 0
    first = CONTEXT + 1 + WARMUP_STEPS  # the last request to start, at the first timed step
    assert first + steps / 2 < context < first + steps / 2 + 8
    assert not engine.has_unfinished_requests()  # drained
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks  # every block back
