"""``benchmarks/serve_bench.py``: its statistics, and one small run against a real server.

The end-to-end test starts the embedded default (one prefill and one decode
worker on CPU) through the benchmark's own ``--config`` path on a free port, runs
a closed-loop and a Poisson point of prompts long enough to be disaggregated,
the engine alone on the same prompts and the low-load TTFT, and reads the JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import serve_bench, serve_engine, serve_report, slo_grid
from benchmarks.serve_load import RequestResult, random_prompts, read_prompts_file, summarize
from splitserve.cluster.serve_command import default_config_path
from splitserve.workers.engine.torch_profiler import read_trace, step_names


def test_random_prompts_are_seeded_and_in_range():
    a = random_prompts(50, 40, 0.5, 8, vocab_size=100, seed="0/rate=inf")
    assert a == random_prompts(50, 40, 0.5, 8, vocab_size=100, seed="0/rate=inf")
    assert a != random_prompts(50, 40, 0.5, 8, vocab_size=100, seed="0/concurrency=2")
    assert all(20 <= len(s.prompt) <= 60 and s.max_tokens == 8 for s in a)
    assert len({len(s.prompt) for s in a}) > 1
    assert all(1 <= t < 100 for s in a for t in s.prompt)


def test_the_engine_alone_times_first_tokens_back_to_back_and_after_idling(monkeypatch):
    """The low-load baseline: each prompt back to back (run to its end), then on a prefill
    worker's duty cycle: idle for as long as that request decoded, the prompt alone."""
    from splitserve import LLM

    llm = LLM("qwen3-tiny")
    free = llm.engine.block_manager.num_free_blocks
    pauses: list[float] = []
    monkeypatch.setattr(serve_engine.time, "sleep", pauses.append)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 6]
    computed: list[int] = []
    step = llm.engine.step

    def counted():  # the prompt tokens each step computes
        outputs = step()
        computed.append(llm.engine.last_step.num_prefill_tokens)
        return outputs

    monkeypatch.setattr(llm.engine, "step", counted)
    back_to_back, idle = serve_engine.time_to_first_token(llm, prompts, [6, 3])
    assert computed.count(16) == computed.count(18) == 2  # both passes compute each prompt
    assert len(back_to_back) == len(idle) == 2
    assert all(t > 0 for t in back_to_back + idle)
    assert len(pauses) == 2 and all(p > 0 for p in pauses)  # the decodes it stands in for
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free


def test_configs_given_with_one_flag_or_several_are_all_run():
    for argv in (["--config", "a.yaml", "b.yaml"], ["--config", "a.yaml", "--config", "b.yaml"]):
        assert serve_bench.parse_args(argv).config == [Path("a.yaml"), Path("b.yaml")]


def test_prompts_file_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt_token_ids": [3, 4], "max_tokens": 5}\n')
    specs = read_prompts_file(path, default_max_tokens=7)
    assert [(s.prompt, s.max_tokens) for s in specs] == [("hi", 7), ([3, 4], 5)]
    path.write_text('{"prompt": "hi", "prompt_token_ids": [1]}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: give exactly one"):
        read_prompts_file(path, 7)


def _result(ttft_ms: float, e2e_ms: float, tokens: int) -> RequestResult:
    gaps = [(e2e_ms - ttft_ms) / 1e3 / (tokens - 1)] * (tokens - 1)
    return RequestResult(
        max_tokens=tokens,
        ok=True,
        ttft_s=ttft_ms / 1e3,
        e2e_s=e2e_ms / 1e3,
        itl_s=gaps,
        output_tokens=tokens,
        prompt_tokens=10,
    )


def test_goodput_counts_requests_meeting_both_slos():
    results = [
        _result(100, 1000, 10),  # TPOT 100 ms
        _result(100, 190, 10),  # TPOT 10 ms: good
        _result(900, 990, 10),  # TTFT too long
        RequestResult(10, error="HTTP 503: overloaded"),
    ]
    s = summarize(results, duration_s=2.0, slo_ttft_ms=500, slo_tpot_ms=20)
    assert (s["completed"], s["failed"], s["wrong_length"]) == (3, 1, 0)
    assert s["goodput"] == 0.5 and s["goodput_fraction"] == 0.25
    assert s["output_throughput"] == 15.0 and s["total_token_throughput"] == 30.0
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["tpot_ms"]["mean"] == pytest.approx(40)
    assert s["errors"] == ["HTTP 503: overloaded"]
    assert summarize(results, 2.0)["goodput_fraction"] == 0.75  # no SLO: every completed one


def _request(ttft_ms: float, tpot_ms: float, tokens: int = 11) -> RequestResult:
    return _result(ttft_ms, ttft_ms + tpot_ms * (tokens - 1), tokens)


def _one_token(ttft_ms: float) -> RequestResult:
    """A completed request of a single token: no TPOT, so it meets any TPOT SLO."""
    return RequestResult(1, ok=True, ttft_s=ttft_ms / 1e3, e2e_s=ttft_ms / 1e3, output_tokens=1)


def _point(value, *runs: list[RequestResult], mode: str = "rate") -> dict:
    """A report's point; its summary is the last run's (standing in for the median run)."""
    runs_out = [
        {
            "summary": summarize(results, duration_s=i + 1.0),
            "requests": [r.record() for r in results],
        }
        for i, results in enumerate(runs)
    ]
    label = f"{mode}={value}"
    return {
        "mode": mode,
        "value": value,
        "label": label,
        "summary": runs_out[-1]["summary"],
        "runs": runs_out,
    }


FAILED = RequestResult(11, error="HTTP 503: overloaded")


def _grid_report() -> dict:
    """Two configs at 2, 4 and 8 req/s, 10 requests a point, against TTFT 20/100/500 ms and
    TPOT 10/20 ms. pd: 2 meets all but TTFT 20; 4 meets TPOT 20 only, 9 of 10 (its summary
    run; the other run meets nothing); 8 meets TTFT 500 + TPOT 20 only. co: 2 meets TPOT 10
    with 9 of 10 because a one-token request has no TPOT; 4 has 2 requests over TTFT 100; 8
    meets nothing. A burst (None: inf in the JSON) and a closed-loop point meet everything
    and must not count."""
    fast = [_request(50, 5)] * 10
    pd = [
        _point(2, fast),
        _point(4, [_request(900, 5)] * 10, [_request(50, 15)] * 9 + [FAILED]),
        _point(8, [_request(300, 15)] * 9 + [_request(50, 5)]),
        _point(None, fast),
        _point(64, fast, mode="concurrency"),
    ]
    co = [
        _point(2, [_request(50, 5)] * 8 + [_one_token(50), _request(50, 15)]),
        _point(4, [_request(50, 15)] * 8 + [_request(400, 15)] * 2),
        _point(8, [_request(600, 5)] * 10),
    ]
    workload = "random token ids (a simulated load shape): input 64, output 11"
    return {
        "workload": workload,
        "configs": [{"label": "pd", "points": pd}, {"label": "co", "points": co}],
    }


def _cells(config: dict, key: str = "rate") -> dict:
    return {(c["ttft_ms"], c["tpot_ms"]): c[key] for c in config["cells"]}


def test_slo_grid_gives_the_highest_rate_each_slo_pair_attains():
    grid = serve_report.slo_grid(_grid_report(), [20, 100, 500], [10, 20], share=0.9)
    assert grid["workload"].startswith("random token ids (a simulated load shape)")
    pd, co = grid["configs"]
    assert [p["rate"] for p in pd["points"]] == [2, 4, 8]  # no burst, no closed loop
    assert _cells(pd) == {
        (20, 10): None, (100, 10): 2, (500, 10): 2,
        (20, 20): None, (100, 20): 4, (500, 20): 8,
    }  # fmt: skip
    assert [k for k, capped in _cells(pd, "capped").items() if capped] == [(500, 20)]
    assert _cells(co) == {
        (20, 10): None, (100, 10): 2, (500, 10): 2,
        (20, 20): None, (100, 20): 2, (500, 20): 4,
    }  # fmt: skip
    assert not any(_cells(co, "capped").values())
    ratio = grid["ratio"]
    assert ratio["of"] == ["pd", "co"]
    assert _cells(ratio, "ratio") == {
        (20, 10): None, (100, 10): 1.0, (500, 10): 1.0,
        (20, 20): None, (100, 20): 2.0, (500, 20): 2.0,
    }  # fmt: skip
    bounds = _cells(ratio, "bound")
    assert (bounds[100, 20], bounds[500, 20], bounds[20, 20]) == ("exact", "lower", None)
    # the second config capped: an upper bound; both: no bound
    first = {
        "label": "a",
        "cells": [{"ttft_ms": 1, "tpot_ms": 1, "rate": 4, "capped": c} for c in (False, True)],
    }
    second = {"label": "b", "cells": [{"ttft_ms": 1, "tpot_ms": 1, "rate": 8, "capped": True}] * 2}
    cells = serve_report.ratio_grid(first, second)["cells"]
    assert [(c["ratio"], c["bound"]) for c in cells] == [(0.5, "upper"), (0.5, "none")]


def test_slo_grid_ratio_of_a_chosen_pair_by_label():
    grid = serve_report.slo_grid(_grid_report(), [100], [20], share=0.9, ratio_of=("co", "pd"))
    assert grid["ratio"]["of"] == ["co", "pd"]
    assert _cells(grid["ratio"], "ratio") == {(100, 20): 0.5}
    with pytest.raises(ValueError, match="no config labelled 'mixed'"):
        serve_report.slo_grid(_grid_report(), [100], [20], ratio_of=("pd", "mixed"))


def test_slo_attainment_is_summarize_goodput_fraction():
    results = [_request(50, 5), _one_token(50), _request(50, 15), _request(300, 5), FAILED]
    records = serve_report.request_results([r.record() for r in results])
    for ttft, tpot in ((100, 10), (500, 10), (100, 20), (None, 10), (100, None)):
        expected = summarize(results, 1.0, ttft, tpot)["goodput_fraction"]
        assert serve_report.attainment(records, ttft, tpot) == expected
    assert serve_report.attainment(records, 100, 10) == 0.4  # the fast one and the one token


def test_slo_grid_command_merges_sweeps_split_across_reports(tmp_path, capsys):
    """Rates 2 and 4 in one file, 4 and 8 in a later one: one curve a config; the later
    file's rate 4 (meeting nothing) replaces the earlier one's."""
    report = _grid_report()
    pd, co = (
        [p for p in c["points"] if p["mode"] == "rate" and p["value"]] for c in report["configs"]
    )
    low = {
        "workload": report["workload"],
        "configs": [{"label": "pd", "points": pd[:2]}, {"label": "co", "points": co[:2]}],
    }
    pd_high = [_point(4, [_request(900, 5)] * 10), pd[2]]
    high = {
        "workload": report["workload"],
        "configs": [{"label": "co", "points": co[2:]}, {"label": "pd", "points": pd_high}],
    }
    first, second, out = tmp_path / "low.json.gz", tmp_path / "high.json", tmp_path / "grid.json"
    serve_report.write_json(first, low)
    serve_report.write_json(second, high)
    slo_grid.main(
        [str(first), str(second), "--ttft-ms", "100", "500", "--tpot-ms", "20", "--json", str(out)]
    )
    grid = json.loads(out.read_text())
    pd_grid, co_grid = grid["configs"]  # in the order first seen
    assert [(p["rate"], Path(p["source"]).name) for p in pd_grid["points"]] == [
        (2, "low.json.gz"), (4, "high.json"), (8, "high.json")
    ]  # fmt: skip
    assert [p["rate"] for p in co_grid["points"]] == [2, 4, 8]
    assert _cells(pd_grid) == {(100, 20): 2, (500, 20): 8}  # 4 is the later file's
    assert _cells(pd_grid, "capped") == {(100, 20): False, (500, 20): True}
    assert _cells(co_grid) == {(100, 20): 2, (500, 20): 4}
    assert _cells(grid["ratio"], "ratio") == {(100, 20): 1.0, (500, 20): 2.0}
    assert grid["replaced"] == [f"pd rate 4: {second} replaces {first}"]
    printed = capsys.readouterr().out
    assert f"pd rate 4: {second} replaces {first} (the later file wins)" in printed
    assert "Load: random token ids (a simulated load shape): input 64, output 11." in printed
    assert "| 20 ms    | 2           | >=8         |" in printed  # pd
    assert "| 20 ms    | 1.00        | >=2.00      |" in printed  # pd over co


@pytest.mark.slow
def test_serve_bench_against_the_embedded_default(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    num, max_tokens = 4, 8
    stages = []  # what each partial report held when it was written

    def spy(path, report, config):
        low = config.get("low_load_ttft") or {}
        stages.append(("engine_baseline" in config, len(config.get("points", [])), bool(low)))
        stages[-1] += ("http_floor" in low,)
        write_partial(path, report, config)

    write_partial = serve_bench.write_partial
    monkeypatch.setattr(serve_bench, "write_partial", spy)
    serve_bench.main(
        ["--config", str(default_config_path()), "--input-len", "40"]
        + ["--output-len", str(max_tokens), "--num-prompts", str(num), "--warmup", "2"]
        + ["--max-concurrency", "2", "--request-rate", "50", "--engine-baseline"]
        + [
            "--low-load-ttft",
            "2",
            "--http-floor",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
        ]
        + ["--json", str(out), "--server-log", str(tmp_path / "server.log")]
        + ["--torch-profiler-dir", str(tmp_path / "traces")]
    )
    assert "splitserve: serving" in (tmp_path / "server.log").read_text()
    report = json.loads(out.read_text())
    assert "partial" not in report  # the partial reports written on the way are replaced
    # one partial report a stage: the engine alone, the low-load TTFT, each point, the floor
    assert stages == [
        (True, 0, False, False),
        (True, 0, True, False),
        (True, 1, True, False),
        (True, 2, True, False),
        (True, 2, True, True),
    ]
    assert "random token ids" in report["workload"]
    assert report["environment"]["commit"]
    (config,) = report["configs"]
    assert [p["label"] for p in config["points"]] == ["rate=50", "concurrency=2"]
    for point in config["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"]) == (num, 0)
        assert s["output_tokens"] == num * max_tokens
        (run,) = point["runs"]
        assert run["summary"] == s
        # profiled: both engines' traces, in the config's own folder, with their steps
        traces = {t["pool"]: t["trace"] for t in run["traces"]}
        assert set(traces) == {"prefill", "decode"}
        for pool, trace in traces.items():
            assert trace.startswith(str(tmp_path / "traces" / "default"))
            assert f"engine_step[{pool}" in " ".join(step_names(read_trace(trace)))
        assert run["routes"] == {'{outcome="ok",route="disaggregated"}': num}
        for r in run["requests"]:
            assert r["ok"] and r["output_tokens"] == max_tokens
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            assert len(r["itl_s"]) == r["token_events"] - 1
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 <= s[metric]["p50"] <= s[metric]["p90"] <= s[metric]["p99"], metric
        assert 0 <= s["goodput_fraction"] <= 1
        assert point["served_vs_engine"] > 0
        assert point["engine"]["output_tokens"] == num * max_tokens
    # the decode worker's own steps over the closed-loop run: every token after the first
    # came from a decode-only step of the decode pool, one request a step each; at the
    # engine alone's batch (2) they are compared with its decode step
    rate, closed_point = config["points"]
    # open loop: the served decode steps, with no engine alone's step to compare them with
    assert rate["decode_steps"]["pool"] == "decode" and rate["decode_steps"]["steps"] > 0
    assert rate["decode_steps"]["served_vs_engine"] is None
    # every run has the engines' steps over it: the prefill worker computed each prompt
    (rate_run,) = rate["runs"]
    rate_prompts = [r for r in rate_run["steps"] if r["pool"] == "prefill"]
    assert sum(r["requests"] for r in rate_prompts) == num
    assert rate["loop_time"]["prefill"]["prefill"]["share"] == pytest.approx(1.0)
    (run,) = closed_point["runs"]
    # the CPU of the server's processes over the run, by role (a run this short may take
    # under a clock tick of some of them)
    cpu = closed_point["cpu"]["processes"]
    parts = {"client", "ingress replica", "decode replica", "prefill replica"}
    assert parts | {"decode engine", "prefill engine", "Ray and others"} <= set(cpu), cpu
    assert sum(cpu.values()) > 0
    assert run["cpu"] == closed_point["cpu"]
    decoded = [r for r in run["steps"] if (r["pool"], r["kind"]) == ("decode", "decode")]
    assert sum(r["requests"] for r in decoded) == num * (max_tokens - 1), run["steps"]
    prompts = [r for r in run["steps"] if r["pool"] == "prefill"]
    assert {r["kind"] for r in prompts} == {"prefill"}
    assert sum(r["requests"] for r in prompts) == num
    steps = closed_point["decode_steps"]  # against the engine alone, batch for batch
    assert (steps["pool"], steps["steps"]) == ("decode", sum(r["steps"] for r in decoded))
    assert {b["batch_bucket"] for b in steps["buckets"]} <= {1, 2}
    for b in steps["buckets"]:
        assert 1 <= b["mean_batch"] <= 2 and b["step_ms"] > 0 and b["engine_step_ms"] > 0
        assert 0 <= b["wait_ms"] <= b["step_ms"]
    assert steps["served_vs_engine"] == pytest.approx(steps["engine_s"] / steps["served_s"])
    loop = closed_point["loop_time"]["decode"]
    assert set(loop) == {"decode"} and loop["decode"]["share"] == pytest.approx(1.0)
    closed = config["engine_baseline"]["points"]["concurrency=2"]
    assert closed["max_num_seqs"] == 2
    # without drafts a decode step gives each request one token: the token's time is the step's
    assert closed["decode_tokens_per_step"] == pytest.approx(1.0)
    assert closed["decode_token_ms"] == pytest.approx(closed["decode_step_ms"])
    low = config["low_load_ttft"]
    assert low["requests"] == 2 and low["served"]["completed"] == 2
    assert low["engine_ttft_ms"]["p50"] > 0 and "added_p50_ms" in low
    assert low["engine_idle_ttft_ms"]["p50"] > 0 and "added_p50_idle_ms" in low
    # the HTTP floor: an echo app behind the same HTTP stack, first chunk after the engine's
    # own TTFT (its p50 alone), on the same two prompts
    floor = low["http_floor"]
    assert floor["completed"] == 2
    assert floor["delay_ms"] == pytest.approx(low["engine_ttft_ms"]["p50"], abs=1e-3)
    assert floor["ttft_ms"]["p50"] >= floor["delay_ms"] and floor["floor_ms"]["p50"] > 0
    assert low["added_over_floor_p50_ms"] == pytest.approx(
        low["added_p50_ms"] - floor["floor_ms"]["p50"]
    )
    # where those two TTFTs went, from /metrics: the ingress's TTFT is the prefill
    # engine's queue and prefill and the serving path; the client's holds it
    split = low["split"]["disaggregated"]
    assert split["requests"] == 2
    parts = split["engine queue"] + split["engine prefill"] + split["serving path"]
    assert split["ingress TTFT"] == pytest.approx(parts, rel=1e-6)
    assert split["engine prefill"] > 0 and split["serving path"] > 0
    assert low["served"]["ttft_ms"]["mean"] > split["ingress TTFT"]
    # the server's forwards by kind (all eager on CPU): every prompt, warm-up included,
    # prefilled on the prefill worker; every request decoded on the decode worker
    forwards = {(f["pool"], f["kind"], f["how"]): f["forwards"] for f in config["forwards"]}
    assert forwards.get(("prefill", "prefill", "eager"), 0) >= 1, forwards
    assert forwards.get(("decode", "decode", "eager"), 0) >= max_tokens - 1, forwards
    assert {how for _, _, how in forwards} == {"eager"}


def test_a_partial_report_holds_the_finished_configs_and_the_running_one(tmp_path):
    path = tmp_path / "r.json"
    report = {"workload": "w", "configs": [{"label": "a", "points": [1]}]}
    serve_bench.write_partial(path, report, {"label": "b", "points": []})
    written = json.loads(path.read_text())
    assert written["partial"] is True
    assert [c["label"] for c in written["configs"]] == ["a", "b"]
    assert [c["label"] for c in report["configs"]] == ["a"]  # the report itself is unchanged


def test_the_floors_wait_is_the_engines_own_ttft():
    alone = {"engine_ttft_ms": {"p50": 12.34567}, "split": {"local_mixed": {}}}
    assert serve_bench.engine_ttft_ms(alone) == 12.346
    split = {"split": {"disaggregated": {"engine queue": 0.25, "engine prefill": 40.5}}}
    assert serve_bench.engine_ttft_ms(split) == 40.75  # no engine alone: the served engine's
    assert serve_bench.engine_ttft_ms({}) == 0.0


def test_the_floor_is_not_measured_behind_another_proxy():
    out = {"label": "c", "low_load_ttft": {"added_p50_ms": 3.0}}
    floor = serve_bench.floor_report({"http": {"proxy": "serve"}}, [], 0, out)
    assert floor == {"http_floor": None, "http_floor_note": "not measured for http.proxy: serve"}


def test_http_floor_needs_a_low_load_run_started_here():
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--http-floor"])
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--url", "http://x:1", "--low-load-ttft", "2", "--http-floor"])
    assert serve_bench.parse_args(["--low-load-ttft", "2", "--http-floor"]).http_floor


def test_a_point_reports_its_median_run():
    assert serve_bench.median_index([900.0, 1300.0, 1000.0]) == 2
    assert serve_bench.median_index([5.0, 1.0, 4.0, 2.0]) == 3  # the lower middle of an even count


def test_the_json_report_keeps_each_request_on_one_line(tmp_path):
    request = RequestResult(max_tokens=2, ok=True, ttft_s=0.1234567, e2e_s=0.2, itl_s=[0.0765432])
    report = {"value": float("inf"), "runs": [{"requests": [request.record()]}]}
    path = tmp_path / "r.json"
    serve_report.write_json(path, report)
    lines = path.read_text().splitlines()
    assert sum('"itl_s":[0.076543]' in line for line in lines) == 1
    loaded = json.loads(path.read_text())
    assert loaded["value"] is None and loaded["runs"][0]["requests"][0]["ttft_s"] == 0.123457


@pytest.mark.slow
def test_a_terminated_benchmark_stops_the_server_it_started(tmp_path):
    """``timeout`` around a benchmark sends SIGTERM: the server it started (in its own
    session, holding the GPUs) is stopped before the benchmark exits, not orphaned."""
    log = tmp_path / "server.log"
    script = (
        "import sys, time\n"
        "from benchmarks import serve_process as sp\n"
        "from splitserve.cluster.serve_command import default_config_path\n"
        f"with sp.served(default_config_path(), '127.0.0.1', None, None, 300, {str(log)!r}):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[1]
    bench = subprocess.Popen(
        [sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert bench.stdout.readline().startswith("starting: ")
        assert bench.stdout.readline().strip() == "up"  # healthy
        server_pid = _server_pid(bench.pid)
        bench.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert bench.wait(timeout=180) == 128 + signal.SIGTERM
        # An idle server stops without Ray Serve's 30 s deregistration window for its
        # ingress (``cluster/app.py``: 2 s): about 11 s on a 2-core box, 37 s with it.
        assert time.monotonic() - sent < 30.0
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(server_pid), "the server outlived the benchmark"
        assert "splitserve: shutting down" in log.read_text()
    finally:
        bench.kill()


def _server_pid(parent: int) -> int:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    (pid,) = [int(c) for c in children]
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().split()
    return stat[2] != "Z"  # a zombie has exited
