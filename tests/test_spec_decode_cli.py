"""MTP speculative decoding as users reach it: ``--speculative-config`` on ``splitserve
generate`` (JSON lines carry the drafts per prompt) and ``splitserve serve`` (checked in the
driver), and the Prometheus counters and acceptance-length histogram per pool."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.cluster.metrics import PoolCollector
from splitserve.cluster.serve_command import load_config
from splitserve.cluster.startup_checks import fit_to_model
from splitserve.config import SpeculativeConfig
from splitserve.workers.engine.messages import WorkerStats
from tests import checkpoints
from tests.mtp_checkpoints import write_glm4_moe_drafter

SPEC = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.fixture(scope="module")
def agreeing_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-agree"))


def _generate(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_json_lines_carry_drafts_and_acceptances(agreeing_glm):
    common = ["--model", str(agreeing_glm), "--prompt", "a b c", "--prompt", "hello there"]
    common += ["--max-tokens", "9", "--temperature", "0", "--ignore-eos", "--json"]
    plain = _generate(*common)
    spec = _generate(*common, "--speculative-config", SPEC)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain_records = [json.loads(line) for line in plain.stdout.splitlines()]
    spec_records = [json.loads(line) for line in spec.stdout.splitlines()]
    assert [r["token_ids"] for r in spec_records] == [r["token_ids"] for r in plain_records]
    assert all("num_draft_tokens" not in r for r in plain_records)
    # 8 tokens after the first: two steps of 2 drafts and a bonus token, then 1 draft (the
    # scheduler's trim to max_tokens) and a bonus: 5 drafts, all accepted
    records = [(r["num_draft_tokens"], r["num_accepted_tokens"]) for r in spec_records]
    assert records == [(5, 5), (5, 5)]


@pytest.mark.parametrize(
    "value, message",
    [
        ("{method: mtp}", "--speculative-config is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ],
)
def test_generate_refuses_a_bad_speculative_config(value, message):
    proc = _generate("--speculative-config", value, "--max-tokens", "2")
    assert proc.returncode == 2
    assert message in proc.stderr


def test_generate_refuses_a_model_without_an_mtp_layer():
    proc = _generate("--model", "qwen3-tiny", "--speculative-config", SPEC, "--max-tokens", "2")
    assert proc.returncode == 2
    assert "needs the checkpoint's MTP layer" in proc.stderr


def _serve_args(**kwargs) -> argparse.Namespace:
    fields = dict(
        config=None, model=None, prefill=None, decode=None, mixed=None, host=None, port=None,
        device=None, address=None, api_key=None, speculative_config=None,
    )  # fmt: skip
    return argparse.Namespace(**{**fields, **kwargs})


def test_serve_takes_the_speculative_config_and_checks_the_checkpoint(agreeing_glm, tmp_path):
    config = load_config(_serve_args(model=str(agreeing_glm), speculative_config=SPEC))
    assert config.engine.speculative_config == SpeculativeConfig("mtp", 2)
    fit_to_model(config)  # the MTP layer is there
    qwen = checkpoints.write_qwen3(tmp_path / "qwen3")
    config = load_config(_serve_args(model=str(qwen), speculative_config=SPEC))
    with pytest.raises(ValueError, match="needs an MTP layer.*num_nextn_predict_layers"):
        fit_to_model(config)
    with pytest.raises(ValueError, match="not JSON"):
        load_config(_serve_args(speculative_config="mtp"))


def test_prometheus_counters_and_acceptance_histogram_per_pool():
    def stats(drafts, accepted, lengths) -> dict:
        return WorkerStats(
            "decode",
            1,
            spec_num_draft_tokens=drafts,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_lengths=lengths,
        ).as_dict()

    snapshot = {
        "d1": ("decode", stats(10, 6, [1, 2, 2])),  # 5 steps of K=2: 0, 1, 1, 2, 2 accepted
        "d2": ("decode", stats(4, 1, [1, 1])),
        "p1": ("prefill", stats(0, 0, [])),
    }
    registry = CollectorRegistry()
    registry.register(PoolCollector(snapshot))
    text = generate_latest(registry).decode()
    assert 'splitserve_spec_decode_num_draft_tokens_total{pool="decode"} 14.0' in text
    assert 'splitserve_spec_decode_num_accepted_tokens_total{pool="decode"} 7.0' in text
    assert 'splitserve_spec_decode_num_draft_tokens_total{pool="prefill"} 0.0' in text
    buckets = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("splitserve_spec_decode_acceptance_length")
    }
    name = "splitserve_spec_decode_acceptance_length"
    assert buckets[f'{name}_bucket{{le="0.0",pool="decode"}}'] == 2
    assert buckets[f'{name}_bucket{{le="1.0",pool="decode"}}'] == 5
    assert buckets[f'{name}_bucket{{le="2.0",pool="decode"}}'] == 7
    assert buckets[f'{name}_bucket{{le="+Inf",pool="decode"}}'] == 7
    assert buckets[f'{name}_count{{pool="decode"}}'] == 7
    assert buckets[f'{name}_sum{{pool="decode"}}'] == 7  # accepted drafts in all
