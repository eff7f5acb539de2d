"""The goodput autoscaler under a load that shifts from long prompts to long outputs.

    python benchmarks/autoscale_shift.py [--phases prompts:45 outputs:60 prompts:45 quiet:75]
        [--json docs/perf/autoscale_shift_cpu.json] [--plot docs/perf/autoscale_shift_cpu.png]

Starts ``splitserve serve`` on the tiny preset (CPU) with both pools autoscaled
between 1 and 2 replicas and a budget of 3 (``autoscaling.max_total_replicas``),
then runs each phase in turn, closed-loop: ``prompts`` (long random prompts, one
output token: prefill work), ``outputs`` (short prompts, long outputs: decode
work), ``quiet`` (nothing). Every second it reads ``/metrics``: per pool the
replicas the autoscaler asks for, the ones it wants before its delays, the live
ones, and its inputs (queued prompt tokens, running requests). It prints each pool's
changes with their times, writes them all as JSON and draws replicas and inputs
over time (``--plot``). The load is simulated (random token ids, a fixed client
count), not a trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import (  # noqa: E402
    git_commit,
    host_info,
    metric_values,
    served,
)

from splitserve.cluster.serve_command import default_config_path  # noqa: E402

POOLS = ("prefill", "decode")
AUTOSCALING = {
    "upscale_delay_s": 3.0,
    "downscale_delay_s": 12.0,
    "window_s": 4.0,
    "max_total_replicas": 3,
}


def serve_config(args: argparse.Namespace) -> dict:
    config = yaml.safe_load(default_config_path().read_text())
    config["pools"] = {
        "prefill": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_queued_prompt_tokens": args.target_queued_prompt_tokens,
        },
        "decode": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_running_requests": args.target_running_requests,
        },
        "mixed": {"replicas": 0},
    }
    config["router"]["prefill_backlog_tokens"] = None  # long prompts always go to prefill
    config["autoscaling"] = AUTOSCALING
    return config


def request(url: str, body: dict, timeout: float = 120.0) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def phase_body(kind: str, rng: random.Random, args: argparse.Namespace) -> dict:
    length, max_tokens = (args.prompt_len, 1) if kind == "prompts" else (8, args.output_len)
    prompt = [rng.randrange(1, 500) for _ in range(length)]  # the tiny preset has 512 ids
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def run_phase(url: str, kind: str, seconds: float, args, statuses: list[int]) -> None:
    if kind == "quiet":
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            statuses.append(request(f"{url}/v1/completions", phase_body(kind, rng, args)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def sample(metrics: dict[str, float], t: float, phase: str) -> dict:
    row: dict = {"t": round(t, 2), "phase": phase}
    for pool in POOLS:
        reason = next(
            (
                m.group(1)
                for name in metrics
                if (
                    m := re.match(
                        rf'splitserve_autoscaler_decision{{pool="{pool}",reason="(\w+)"', name
                    )
                )
            ),
            None,
        )
        row[pool] = {
            "target": metrics.get(f'splitserve_autoscaler_target_replicas{{pool="{pool}"}}'),
            "desired": metrics.get(f'splitserve_autoscaler_desired_replicas{{pool="{pool}"}}'),
            "live": metrics.get(f'splitserve_pool_replicas{{pool="{pool}"}}', 0.0),
            "reason": reason,
        }
        for name in ("queued_prompt_tokens", "running_requests"):
            key = f'splitserve_autoscaler_pool_input{{input="{name}",pool="{pool}"}}'
            row[pool][name] = metrics.get(key)
    return row


def monitor(url: str, start: float, phase: list[str], rows: list[dict], stop) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):  # a slow scrape: the next second's will do
            rows.append(sample(metric_values(url), time.monotonic() - start, phase[0]))
        stop.wait(1.0)


def wait_for_autoscaler(url: str, timeout: float) -> None:
    """Until every pool has a live replica and the autoscaler has posted its decision."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            row = sample(metric_values(url), 0.0, "start")
            if all(row[p]["target"] is not None and row[p]["live"] for p in POOLS):
                return
        time.sleep(1.0)
    raise RuntimeError(f"the autoscaler posted no decision within {timeout} s")


def changes(rows: list[dict], pool: str) -> list[tuple[float, float, str]]:
    """(time, new target, phase) at each change of the pool's target."""
    out, last = [], None
    for row in rows:
        target = row[pool]["target"]
        if target is not None and target != last:
            out.append((row["t"], target, row["phase"]))
            last = target
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["samples"]
    t = [r["t"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for pool in POOLS:
        c = colors[pool]
        top.step(
            t, [r[pool]["target"] for r in rows], where="post", color=c, label=f"{pool} target"
        )
        top.plot(t, [r[pool]["live"] for r in rows], ":", color=c, label=f"{pool} live")
    bottom.plot(t, [r["prefill"]["queued_prompt_tokens"] for r in rows], color=colors["prefill"])
    bottom.set_ylabel("prefill queued prompt tokens", color=colors["prefill"])
    right = bottom.twinx()
    right.plot(t, [r["decode"]["running_requests"] for r in rows], color=colors["decode"])
    right.set_ylabel("decode running requests", color=colors["decode"])
    for start, end, kind in result["phase_times"]:
        for ax in (top, bottom):
            ax.axvspan(
                start,
                end,
                alpha=0.08,
                color={"prompts": "blue", "outputs": "orange"}.get(kind, "grey"),
            )
        top.text(start + 1, 2.35, kind, fontsize=8)
    top.set_ylim(0, 2.6)
    top.set_yticks([0, 1, 2])
    top.set_ylabel("replicas")
    top.legend(loc="lower right", fontsize=7, ncol=2)
    bottom.set_xlabel("seconds")
    a = result["autoscaling"]
    fig.suptitle(
        f"Goodput autoscaler, simulated load on CPU (up {a['upscale_delay_s']:g} s, "
        f"down {a['downscale_delay_s']:g} s, budget {a['max_total_replicas']} replicas)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--phases", nargs="+", default=["prompts:45", "outputs:60", "prompts:45", "quiet:75"]
    )
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=900)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--target-queued-prompt-tokens", type=int, default=1024)
    p.add_argument("--target-running-requests", type=int, default=4)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    phases = [(kind, float(s)) for kind, s in (x.split(":") for x in args.phases)]
    bad = [k for k, _ in phases if k not in ("prompts", "outputs", "quiet")]
    if bad:
        p.error(f"unknown phase {bad[0]!r}: phases are prompts, outputs, quiet (KIND:SECONDS)")
    config = serve_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "autoscale.yaml"
        path.write_text(yaml.safe_dump(config))
        with served(path, "127.0.0.1", None, None, startup_s=300) as url:
            wait_for_autoscaler(url, timeout=300)
            rows, statuses, phase_times = [], [], []
            current, stop = ["start"], threading.Event()
            start = time.monotonic()
            watcher = threading.Thread(target=monitor, args=(url, start, current, rows, stop))
            watcher.start()
            try:
                for kind, seconds in phases:
                    current[0] = kind
                    began = time.monotonic() - start
                    run_phase(url, kind, seconds, args, statuses)
                    phase_times.append((round(began, 2), round(time.monotonic() - start, 2), kind))
            finally:
                stop.set()
                watcher.join()
    result = {
        "autoscaling": AUTOSCALING,
        "pools": config["pools"],
        "args": {k: str(v) for k, v in vars(args).items()},
        "phase_times": phase_times,
        "requests": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "changes": {pool: changes(rows, pool) for pool in POOLS},
        "samples": rows,
        "commit": git_commit(Path(__file__).resolve().parents[1]),
        "host": host_info(),
    }
    for pool in POOLS:
        moves = ", ".join(f"{t:.0f} s -> {n:g} ({ph})" for t, n, ph in result["changes"][pool])
        print(f"{pool}: {moves}")
    print(f"requests by HTTP status: {result['requests']}")
    if set(result["requests"]) != {"200"}:
        print("warning: requests failed; the load was not what the phases say")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
