"""`splitserve generate` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from splitserve import LLM, SamplingParams


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_json_lines_in_input_order(tmp_path):
    lines = [
        {"prompt": "Hello world"},
        {"prompt_token_ids": [5, 6, 7, 8]},
        {"prompt": "The quick brown fox", "max_tokens": 4},
    ]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["--prompts-file", str(f), "--prompt", "decode", "--max-tokens", "6"]
    proc = _run(*args, "--temperature", "0", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    # --prompt flags come first, then the file's lines.
    assert [len(r["token_ids"]) for r in records] == [6, 6, 6, 4]
    assert records[2]["prompt_token_ids"] == [5, 6, 7, 8]
    assert all(r["finish_reason"] == "length" for r in records)

    llm = LLM("qwen3-tiny")
    want = llm.generate(
        "decode", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert records[1]["prompt_token_ids"] == llm.tokenizer.encode("Hello world")
    assert records[0]["token_ids"] == want.outputs[0].token_ids
    assert records[0]["text"] == want.outputs[0].text


def test_bad_lines_are_rejected_and_the_rest_served(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        '{"prompt": "ok"}\n'
        "not json\n"
        '{"prompt": "hot", "temperature": -2}\n'
        '{"prompt": "x", "temprature": 0.5}\n'
        '{"prompt": "fine"}\n'
    )
    proc = _run("--prompts-file", str(f), "--max-tokens", "3", "--json")
    assert proc.returncode == 1
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 5
    assert "not a JSON object" in records[1]["error"]
    assert "temperature" in records[2]["error"] and ">= 0" in records[2]["error"]
    assert "temprature" in records[3]["error"] and "temperature" in records[3]["error"]
    assert len(records[0]["token_ids"]) == len(records[4]["token_ids"]) == 3


def test_unknown_dtype_fails_fast_with_the_accepted_values():
    proc = _run("--dtype", "int4")
    assert proc.returncode == 2
    assert "unknown dtype 'int4'; accepted: float32, bfloat16, float16" in proc.stderr
