"""FP8 KV served end to end: ``cache.kv_cache_dtype: fp8_e4m3`` on one prefill and one
decode worker (a real ``splitserve serve``, KV over the CPU transport), over HTTP.

The served greedy tokens equal the offline engine's with the same FP8 cache: the first
request, the same long prompt on both sides, calibrates the scales (the prefill
worker's; the decode worker adopts them with the first hand-off's pages).
"""

from __future__ import annotations

import pytest

from tests import checkpoints
from tests.serve_harness import offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
NUM_BLOCKS = 128
FP8_BYTES_PER_TOKEN = 3 * 2 * 2 * 16  # the tiny Qwen3's layers x (K, V) x KV heads x head_dim
PROMPTS = (  # disaggregated (24 tokens and more), local, disaggregated
    "Prefill computes the prompt; decode generates one token at a time from the KV cache. " * 2,
    "Hello world!",
    "An FP8 cache holds twice the tokens of a bf16 one, and its hand-off moves half the bytes.",
)


def test_served_fp8_greedy_equals_the_offline_fp8_engine(tmp_path):
    model_dir = checkpoints.write_qwen3(tmp_path / "qwen3")
    config = one_prefill_one_decode_config(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    config["engine"]["cache"]["kv_cache_dtype"] = "fp8_e4m3"
    offline = offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN, kv_cache_dtype="fp8_e4m3")
    prompt_tokens = []
    with serving(config, tmp_path) as server:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            status, out = server.post("/v1/completions", body)
            assert status == 200, out
            (choice,) = out["choices"]
            assert choice["token_ids"] == offline(out["prompt_token_ids"], 16), prompt
            prompt_tokens.append(len(out["prompt_token_ids"]))
        m = server.metrics_when('splitserve_kv_transfers_total{pool="prefill"}', 2)
        assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == 2
        assert m['splitserve_requests_total{outcome="ok",route="local_short"}'] == 1
        # The hand-offs moved the long prompts' rows at one byte an element (float32: 4).
        sent = m['splitserve_kv_transfer_bytes_total{pool="prefill"}']
        assert sent == FP8_BYTES_PER_TOKEN * (prompt_tokens[0] + prompt_tokens[2])
        server.wait_all_blocks_free()
