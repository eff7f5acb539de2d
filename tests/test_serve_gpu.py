"""``splitserve serve`` on two GPUs: the prefill worker hands the KV to the decode
worker over NCCL (each prompt sent with the reservation, its ticket after it), and the
tokens equal the offline engine's on one GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests import checkpoints
from tests.serve_harness import serving

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

ENGINE = {
    "device": "cuda",
    "dtype": "bfloat16",
    "cache": {"block_size": 16, "num_kv_blocks": 1024},
    "scheduler": {"max_model_len": 512, "max_num_batched_tokens": 1024, "max_num_seqs": 32},
}
PROMPTS = [list(range(3, 3 + n)) for n in (40, 97, 200)]  # all above local_prompt_tokens


def test_nccl_hand_off_serves_the_offline_engines_tokens(tmp_path):
    model = checkpoints.write_qwen3(tmp_path / "model", head_dim=128)
    offline = LLM(
        str(model),
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=1024,
        max_model_len=512,
        max_num_batched_tokens=1024,
        max_num_seqs=32,
    )
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [
        offline.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        for p in PROMPTS
    ]
    del offline
    torch.cuda.empty_cache()
    config = {
        "engine": {
            **ENGINE,
            "model": str(model),
            "kv_transfer": {"transport": "nccl", "timeout_s": 60},
        },
        "pools": {
            "prefill": {"replicas": 1, "num_gpus": 1},
            "decode": {"replicas": 1, "num_gpus": 1},
        },
        "router": {"local_prompt_tokens": 24},
        "served_model_name": "tiny",
    }
    with serving(config, tmp_path, startup_s=300) as server:
        for prompt, tokens in zip(PROMPTS, expected):
            body = {
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            status, out = server.post("/v1/completions", body)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == tokens
        m = server.metrics_when('splitserve_kv_transfers_total{pool="prefill"}', len(PROMPTS))
        assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == len(PROMPTS)
        assert m['splitserve_kv_transfer_bytes_total{pool="prefill"}'] > 0
        # each prompt went to the prefill worker with the reservation, its ticket after
        assert m['splitserve_kv_late_tickets_total{pool="prefill"}'] == len(PROMPTS)

        failures: list[str] = []

        def stream(i: int) -> None:
            events = server.stream("/v1/completions", {**body, "prompt": PROMPTS[i % 3]})
            if not events or events[-1]["choices"][0].get("finish_reason") is None:
                failures.append(f"stream {i}: {events[-1:]}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not failures, failures
        server.wait_all_blocks_free()
