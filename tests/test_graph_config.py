"""CUDA-graph settings and what can be checked of the graph machinery without a GPU."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.config import CudaGraphConfig, EngineConfig
from splitserve.workers.runner.cuda_graphs.owner import bucket
from tests import checkpoints


def test_default_decode_sizes_cover_max_num_seqs():
    config = CudaGraphConfig()
    assert config.decode_capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert config.decode_capture_sizes(10) == [1, 2, 4, 8, 10]
    assert config.decode_capture_sizes(1) == [1]
    assert CudaGraphConfig(decode_sizes=[8, 1, 8, 3]).decode_capture_sizes(64) == [1, 3, 8]


def test_graph_config_errors_name_the_key():
    with pytest.raises(ValueError, match="cuda_graph.prefill_sizes"):
        EngineConfig.from_dict({"cuda_graph": {"prefill_sizes": [16, 0]}})
    with pytest.raises(ValueError, match="cuda_graph.decode_sizes"):
        EngineConfig.from_dict({"cuda_graph": {"decode_sizes": []}})
    with pytest.raises(ValueError, match="unknown config key 'cuda_graph.max_size'"):
        EngineConfig.from_dict({"cuda_graph": {"max_size": 8}})


def test_kernel_config_errors_name_the_key():
    assert EngineConfig().kernels.split_kv_max_batch == 64
    config = EngineConfig.from_dict({"kernels": {"split_kv_max_batch": 0}})
    assert config.kernels.split_kv_max_batch == 0  # FlashInfer decodes every batch
    with pytest.raises(ValueError, match="kernels.split_kv_max_batch=-1"):
        EngineConfig.from_dict({"kernels": {"split_kv_max_batch": -1}})
    assert EngineConfig().kernels.fp8_decode == "auto"
    assert EngineConfig.from_dict({"kernels": {"fp8_decode": "mma"}}).kernels.fp8_decode == "mma"
    assert EngineConfig.from_dict({"kernels": {"fp8_decode": "xqa"}}).kernels.fp8_decode == "xqa"
    with pytest.raises(ValueError, match="kernels.fp8_decode='flashinfer': must be one of"):
        EngineConfig.from_dict({"kernels": {"fp8_decode": "flashinfer"}})
    with pytest.raises(ValueError, match="kernels.split_kv_max_batch=True"):
        EngineConfig.from_dict({"kernels": {"split_kv_max_batch": True}})
    with pytest.raises(ValueError, match="unknown config key 'kernels.split_kv_max_batches'"):
        EngineConfig.from_dict({"kernels": {"split_kv_max_batches": 8}})


def test_bucket_is_the_smallest_size_that_holds_the_step():
    assert bucket([1, 2, 4, 8], 1) == 1
    assert bucket([1, 2, 4, 8], 3) == 4
    assert bucket([1, 2, 4, 8], 8) == 8
    with pytest.raises(ValueError, match="exceed the largest captured size 8"):
        bucket([1, 2, 4, 8], 9)


def test_no_graphs_on_cpu():
    llm = LLM("qwen3-tiny", device="cpu", num_kv_blocks=64, max_model_len=128)
    assert llm.engine.runner.graphs is None


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (6, 19)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_update_parameters_follows_the_new_weights(tmp_path):
    first = checkpoints.write_qwen3(tmp_path / "a", seed=1)
    second = checkpoints.write_qwen3(tmp_path / "b", seed=7)
    llm = LLM(str(first), device="cpu", num_kv_blocks=64, max_model_len=128)
    before = _tokens(llm)
    llm.engine.clear_parameters()
    assert all(p.numel() == 0 for p in llm.engine.runner.model.parameters())
    llm.engine.update_parameters(second)
    after = _tokens(llm)
    assert after == _tokens(LLM(str(second), device="cpu", num_kv_blocks=64, max_model_len=128))
    assert after != before
    assert llm.engine.block_manager.hash_to_block_id  # caching again, from the new weights


def test_update_parameters_refuses_a_busy_engine(tmp_path):
    path = checkpoints.write_qwen3(tmp_path / "a")
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_model_len=128)
    llm.engine.add_request("busy", list(range(5, 20)), GREEDY)
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        llm.engine.update_parameters(path)
