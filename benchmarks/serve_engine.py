"""The engine alone, for ``serve_bench.py``: ``LLM`` on the prompts the server gets.

    python benchmarks/serve_engine.py SPEC.json OUT.json

Runs in a process of its own, before the server starts, so the two never share
the CPU or GPU. SPEC (written by ``engine_baseline``)::

    {"engine": the serve config's engine section (a mixed engine is built from it),
     "threads": torch threads or null (torch's default; Ray's workers get 1 each),
     "warmup": [prompt, ...], "max_tokens": int,
     "points": [{"label": str, "runs": [{"prompts": [...], "max_tokens": [...]}, ...],
                 "max_num_seqs": int|null}],
     "ttft": {"prompts": [...], "max_tokens": [...]}}

- a point: ``LLM.generate`` on each run's prompts, greedy with ``ignore_eos``,
  with the scheduler's ``max_num_seqs`` lowered to the point's (the serving
  point's concurrency): output and total tokens/s over the call's wall time;
  the point's figures are the median run's (by output tokens/s), with ``runs``;
- decoding alone, for a closed-loop point: the first run's prompts added a group at a
  time, each group stepped until it has its first tokens, the batch timed at 1, 8,
  16, ... (``decode_step_ms_by_batch``, ``decode_context_by_batch``) and at the
  point's batch, ``DECODE_STEPS`` steps (``decode_step_ms``, ``decode_batch``, and a
  request's tokens a step, ``decode_tokens_per_step``: above 1 with speculative
  decoding, so ``decode_token_ms`` is what a decode worker's served TPOT is compared
  with), then again with longer contexts (the step's time a context token); the served
  engines' own decode steps are compared with these at their batch and context
  (``serve_steps.py``);
- TTFT: one request at a time through the ``LLM``'s engine step loop
  (``llm.engine.add_request`` then ``step()``), from adding it to the step that
  returns its first token: back to back (``ttft_s``; a mixed worker at low load), and
  on a prefill worker's duty cycle (``ttft_idle_s``: each prompt after the engine
  idled for as long as the previous request decoded).
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_baseline(spec: dict, timeout_s: float = 3600.0) -> dict:
    """Run this file on ``spec`` in a subprocess; its report."""
    with tempfile.TemporaryDirectory(prefix="serve_engine_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"the engine baseline failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        return json.loads(out_path.read_text())


def build_llm(engine: dict, max_num_seqs: int | None):
    """A mixed-role ``LLM`` from a serve config's engine section, as the workers build theirs."""
    from splitserve import LLM

    values = copy.deepcopy(engine)
    values["role"] = "mixed"
    if max_num_seqs is not None:
        values["scheduler"] = {**(values.get("scheduler") or {}), "max_num_seqs": max_num_seqs}
    return LLM(values.pop("model", "qwen3-tiny"), **values)


def configured_max_num_seqs(engine: dict) -> int:
    from splitserve.config import EngineConfig

    return EngineConfig.from_dict(engine).scheduler.max_num_seqs


def run_point(llm, prompts: list, max_tokens: list[int]) -> dict:
    from splitserve import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"the engine rejected {len(errors)} prompts, e.g. {errors[0]}")
    output = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "duration_s": seconds,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_throughput": output / seconds,
        "total_token_throughput": (prompt + output) / seconds,
    }


DECODE_STEPS = 32  # timed at the point's batch, twice
SMALLER_BATCH_STEPS = 16  # timed at each smaller batch


def context_steps(max_tokens: list[int]) -> int:
    """Steps between the two timings at the point's batch: half the longest output, so
    the later one and the smaller batches run at about the mean context of the served
    requests (a prompt and half its output), where their steps are compared."""
    return max(DECODE_STEPS, max(max_tokens) // 2)


def smaller_batches(batch: int) -> list[int]:
    """The batches timed below a point's, largest first: 1, 8, then every 16."""
    return sorted({b for b in (1, 8, *range(16, batch, 16)) if b < batch}, reverse=True)


def decode_step(llm, prompts: list, max_tokens: list[int]) -> dict:
    """The engine's decode step with a batch decoding (prompts computed), the batch built
    up: at each of ``smaller_batches`` (``decode_step_ms_by_batch``, with each timing's
    mean context a request, ``decode_context_by_batch``), then at the point's
    (``decode_step_ms``), and there again ``context_steps`` steps later: the step's time
    a request's context token (``decode_ms_per_context_token``: the KV that attention
    reads). Built up, not cut down, so that every batch is timed near the prompts'
    length, as the served requests are. Each request may decode past its
    ``max_tokens`` here, so none ends while it is timed."""
    engine, n = llm.engine, len(prompts)
    gap = context_steps(max_tokens)
    steps = 2 * DECODE_STEPS + gap + SMALLER_BATCH_STEPS * len(smaller_batches(n)) + n + 1
    timed, added = {}, 0
    for batch in [*reversed(smaller_batches(n)), n]:
        _start_decoding(engine, prompts[added:batch], max_tokens[added:batch], added, steps)
        added = batch
        if batch < n:
            timed[batch] = _timed_decode(engine, SMALLER_BATCH_STEPS)
    batch = len(engine.scheduler.running)
    first = _timed_decode(engine, DECODE_STEPS)
    for _ in range(gap):
        engine.step()
    later = _timed_decode(engine, DECODE_STEPS)
    longer = max(later["context"] - first["context"], 1e-9)
    timed[batch] = first
    for i in range(n):
        engine.abort_request(f"decode-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    ms, per_step = first["seconds"] * 1e3, first["tokens_per_step"]
    return {
        "decode_batch": batch,
        "decode_step_ms": ms,
        "decode_tokens_per_step": per_step,
        "decode_token_ms": ms / max(per_step, 1e-9),
        "decode_step_ms_by_batch": {str(b): t["seconds"] * 1e3 for b, t in sorted(timed.items())},
        "decode_context_by_batch": {str(b): t["context"] for b, t in sorted(timed.items())},
        "decode_ms_per_context_token": max(
            0.0, (later["median_seconds"] - first["median_seconds"]) * 1e3 / (batch * longer)
        ),
    }


def _start_decoding(engine, prompts: list, max_tokens: list[int], first_id: int, steps: int):
    """Add ``prompts`` (ids ``decode-{first_id}`` on) and step until each has its first
    token; each may decode ``steps`` tokens (within the context length)."""
    from splitserve import SamplingParams

    waiting = set()
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens), first_id):
        room = engine.max_model_len - len(prompt)  # a text prompt: fewer tokens than this
        params = SamplingParams(max_tokens=max(m, min(steps, room)), temperature=0, ignore_eos=True)
        engine.add_request(f"decode-{i}", prompt, params)
        waiting.add(f"decode-{i}")
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}


def _timed_decode(engine, steps: int) -> dict:
    """Over ``steps`` steps: seconds a step (the mean, and the median: what the context's
    slope is read from, so one slow step does not tilt it), a request's tokens a step
    (1 + its accepted drafts) and its mean context (tokens in the KV after a step)."""
    durations, tokens, rows, context = [], 0, 0, 0
    for _ in range(steps):
        rows += len(engine.scheduler.running)
        start = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        durations.append(time.perf_counter() - start)
        context += engine.last_step.num_context_tokens
    return {
        "seconds": sum(durations) / steps,
        "median_seconds": statistics.median(durations),
        "tokens_per_step": tokens / max(rows, 1),
        "context": context / max(rows, 1),
    }


def time_to_first_token(llm, prompts: list, max_tokens: list[int]) -> tuple[list, list]:
    """Seconds from ``add_request`` to the step that returns the first token, one request
    at a time: back to back (each runs to its end, then the next comes), and on a prefill
    worker's duty cycle (the prompt alone, then the engine idles for as long as the
    request's decoding took back to back, as a prefill worker does while its decode
    worker decodes: an idle CPU or GPU computes the next prompt slower)."""
    engine, back_to_back, decode_s = llm.engine, [], []
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        first, total = _first_token(engine, f"ttft-{i}", prompt, m, to_the_end=True)
        back_to_back.append(first)
        decode_s.append(total - first)
    idle = []
    for i, (prompt, pause) in enumerate(zip(prompts, decode_s)):
        engine.block_manager.reset_prefix_cache()  # computed again, not a prefix-cache hit
        time.sleep(pause)
        idle.append(_first_token(engine, f"ttft-idle-{i}", prompt, 2, to_the_end=False)[0])
    return back_to_back, idle


def _first_token(engine, rid: str, prompt, max_tokens: int, to_the_end: bool):
    """Seconds to the step with the request's first token, and to its end (``to_the_end``;
    else it is aborted there)."""
    from splitserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, first = time.perf_counter(), None
    engine.add_request(rid, prompt, params)
    while first is None or (to_the_end and engine.has_unfinished_requests()):
        if any(out.new_token_ids for out in engine.step()) and first is None:
            first = time.perf_counter() - start
    if not to_the_end:
        engine.abort_request(rid)
    return first, time.perf_counter() - start


def main(spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    engine = spec["engine"]
    cap = configured_max_num_seqs(engine)
    report = {"torch_threads": torch.get_num_threads(), "max_num_seqs": cap, "points": {}}
    llms: dict[int, object] = {}

    def llm_for(max_num_seqs: int | None):
        n = min(max_num_seqs or cap, cap)
        if n not in llms:
            llms.clear()  # one engine at a time: the last one's memory goes first
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            llms[n] = build_llm(engine, n)
            warm = spec["warmup"]
            run_point(llms[n], warm, [spec["max_tokens"]] * len(warm))
        return llms[n], n

    for point in spec["points"]:
        llm, n = llm_for(point["max_num_seqs"])
        runs = [run_point(llm, r["prompts"], r["max_tokens"]) for r in point["runs"]]
        median = sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]
        report["points"][point["label"]] = {**median, "max_num_seqs": n, "runs": runs}
        if point["max_num_seqs"] is not None:  # closed loop: its batch decoding alone
            first = point["runs"][0]
            report["points"][point["label"]].update(
                decode_step(llm, first["prompts"][:n], first["max_tokens"][:n])
            )
        del llm  # held only by llm_for, which may replace it
    if spec.get("ttft"):
        llm, _ = llm_for(None)
        ttft = spec["ttft"]
        ttft_s = time_to_first_token(llm, ttft["prompts"], ttft["max_tokens"])
        report["ttft_s"], report["ttft_idle_s"] = ttft_s
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/serve_engine.py SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
