"""``splitserve serve`` with MTP on one prefill and one decode worker (CPU, Ray): greedy
completions, disaggregated and local, equal the offline engine's without MTP, and every KV
block comes back on both workers."""

from __future__ import annotations

import pytest

from tests.mtp_checkpoints import write_glm4_moe_drafter
from tests.serve_harness import offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256
LONG_PROMPT = "Prefill computes the prompt; decode generates one token at a time. " * 2
SHORT_PROMPT = "Hello world!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-serve"), context_scale=0.15)


def test_served_mtp_completions_equal_the_offline_engine(model_dir, tmp_path):
    config = one_prefill_one_decode_config(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    config["engine"]["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    offline = offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    with serving(config, tmp_path) as server:
        for prompt in (LONG_PROMPT, SHORT_PROMPT):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
            status, out = server.post("/v1/completions", {**body, "return_token_ids": True})
            assert status == 200, out
            (choice,) = out["choices"]
            assert choice["token_ids"] == offline(out["prompt_token_ids"], 16)
        m = server.metrics_when('splitserve_kv_transfers_total{pool="prefill"}', 1)
        assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == 1
        server.wait_all_blocks_free()
