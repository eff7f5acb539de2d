"""Decode-sized linears against their memory floor: cuBLAS and the Triton kernel.

    python benchmarks/linear_roofline.py [--sweep] [--quick] [--json [PATH]] [--label KIND]

On one GPU, bf16, random data: the Qwen3-8B projections (qkv 4096->6144,
o 4096->4096, gate_up 4096->24576, down 12288->4096, LM head 4096->151936) at
M = 1..64 rows, through ``F.linear`` (cuBLAS) and the Triton kernel of
``kernels/triton/linear.py`` with its default tiles (``ops.linear`` uses it up
to ``MAX_M`` rows; larger M are timed for comparison). The floor is the
bytes (weight, x, out) at the device-to-device copy bandwidth measured in the
same run; ``x floor`` is time / floor (below 1: faster than a copy of those
bytes). Each timing is the median of CUDA-event spans with L2 flushed before
each call, as a forward reads each weight once. Both results are checked
against ``F.linear`` in float32 first; a Triton result off by more than
``TOLERANCE`` is not timed, and the command exits with status 1.

A total per M sums a decode step's linears (``LAYERS`` layers of qkv, o,
gate_up and down, one LM head).

``--sweep``: for M in ``SWEEP_ROWS``, up to about 30 tilings per shape
(``sweep_configs``: GEMV and ``tl.dot`` tiles, a few split-K factors), each
checked, then timed with fewer repeats; prints the best against the default,
so ``default_config`` can be set from one run. ``--json`` writes the report
(default ``docs/perf/linear_<label>.json``).
"""

from __future__ import annotations

import argparse
import math
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # run as a script: benchmarks/ is on the path
    import roofline
except ImportError:  # imported as benchmarks.linear_roofline (the tests)
    from benchmarks import roofline

from splitserve.kernels.triton.linear import MAX_M, LinearConfig, default_config

DEVICE = "cuda"
DTYPE = torch.bfloat16
LAYERS = 36  # Qwen3-8B
SHAPES = {  # name: (N, K), weight [N, K]
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
PER_STEP = {"qkv": LAYERS, "o": LAYERS, "gate_up": LAYERS, "down": LAYERS, "lm_head": 1}
ROWS, ROWS_QUICK = [1, 2, 4, 8, 16, 32, 64], [1, 4, 16]
SWEEP_ROWS = [1, 4, 16, 64]
TOLERANCE = 2e-2  # bf16 out against float32, as the kernel tests
# tiles of the sweep (block_n, block_k, num_warps, num_stages); split-K factors come on top.
# The GEMV's float32 partial products take block_n * block_k / (32 * num_warps) registers.
GEMV_TILES = [(16, 512, 4, 4), (16, 512, 4, 2), (16, 512, 8, 4), (8, 512, 4, 4),
              (32, 256, 4, 4), (16, 256, 4, 6), (32, 512, 8, 3)]  # fmt: skip
DOT_TILES = [(16, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4),
             (32, 64, 4, 6), (64, 256, 8, 3), (16, 256, 4, 5)]  # fmt: skip


# ---- shape math (pure) -------------------------------------------------------------


def linear_bytes(m: int, n: int, k: int, dtype=DTYPE) -> int:
    """Bytes a linear must move: read the weight and x, write the output."""
    return (n * k + m * k + m * n) * dtype.itemsize


def floor_us(nbytes: int, gbps: float) -> float:
    return nbytes / gbps / 1e3


def split_factors(programs: int, k: int, block_k: int, num_sms: int) -> list[int]:
    """1, and the powers of two that keep the grid within 8 programs an SM and each
    split at least two K tiles."""
    splits = [1]
    while (s := 2 * splits[-1]) <= 16 and programs * s <= 8 * num_sms and k // s >= 2 * block_k:
        splits.append(s)
    return splits


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[LinearConfig]:
    """The tilings ``--sweep`` times for one shape, the default first: at one row the
    GEMV tiles and three ``tl.dot`` tiles, else all the ``tl.dot`` tiles; each with
    the split-K factors of ``split_factors``."""
    tiles = [(t, True) for t in DOT_TILES]
    if m == 1:
        tiles = [(t, False) for t in GEMV_TILES] + tiles[:3]
    configs = [default_config(m, n, k)]
    for (block_n, block_k, warps, stages), use_dot in tiles:
        if k % block_k:
            continue
        for split in split_factors(-(-n // block_n), k, block_k, num_sms):
            cfg = LinearConfig(block_n, block_k, split, warps, stages, use_dot)
            if cfg not in configs:
                configs.append(cfg)
    return configs


def describe(cfg: LinearConfig) -> str:
    """``gemv 16x512 s2 w4 st4``: path, block_n x block_k, split-K, warps, stages."""
    path = "dot" if cfg.use_dot else "gemv"
    return f"{path} {cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64; NaN when out holds a NaN."""
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return math.nan
    return ((out - ref).abs().max() / ref.abs().max()).item()


# ---- measuring (GPU) ---------------------------------------------------------------


class Operands:
    """One shape's bf16 weight (and its float32 copy for the checks) and x per M."""

    def __init__(self, n: int, k: int):
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        self.weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(DTYPE)
        self.weight_f32 = self.weight.float()
        self.gen = gen

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.weight.shape[1], generator=self.gen, device=DEVICE).to(DTYPE)


def measure_row(name: str, m: int, ops: Operands, copy_gbps: float, timing: dict) -> dict:
    from splitserve.kernels.triton.linear import small_m_linear

    n, k = SHAPES[name]
    x, w = ops.x(m), ops.weight
    ref = F.linear(x.float(), ops.weight_f32)
    cfg = default_config(m, n, k)
    row = {"shape": name, "n": n, "k": k, "m": m, "config": describe(cfg)}
    row["ops_uses"] = "triton" if m <= MAX_M else "cublas"
    row["floor_us"] = floor_us(linear_bytes(m, n, k), copy_gbps)
    row["cublas_err"] = rel_err(F.linear(x, w), ref)
    row["triton_err"] = rel_err(small_m_linear(x, w, None, cfg), ref)
    row["cublas_us"] = 1e3 * roofline.time_cuda_ms(lambda: F.linear(x, w), **timing)
    if not row["triton_err"] <= TOLERANCE:  # NaN too
        row["error"] = f"relative error {row['triton_err']:.3g} > {TOLERANCE:g}"
        return row
    row["triton_us"] = 1e3 * roofline.time_cuda_ms(
        lambda: small_m_linear(x, w, None, cfg), **timing
    )
    row["cublas_x_floor"] = row["cublas_us"] / row["floor_us"]
    row["triton_x_floor"] = row["triton_us"] / row["floor_us"]
    row["speedup"] = row["cublas_us"] / row["triton_us"]
    return row


def sweep_shape(name: str, m: int, ops: Operands, num_sms: int, timing: dict) -> dict:
    """Every config of ``sweep_configs`` checked and timed; the default is the first."""
    from splitserve.kernels.triton.linear import small_m_linear

    n, k = SHAPES[name]
    x, w = ops.x(m), ops.weight
    ref = F.linear(x.float(), ops.weight_f32)
    results = []
    for cfg in sweep_configs(m, n, k, num_sms):
        entry = {"config": describe(cfg), **asdict(cfg)}
        try:
            err = rel_err(small_m_linear(x, w, None, cfg), ref)
            if not err <= TOLERANCE:
                entry["error"] = f"relative error {err:.3g}"
            else:
                run = lambda cfg=cfg: small_m_linear(x, w, None, cfg)
                entry["us"] = 1e3 * roofline.time_cuda_ms(run, **timing)
        except Exception as e:  # a tiling Triton refuses (shared memory) must not stop the sweep
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        results.append(entry)
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    default = results[0]
    return {
        "shape": name,
        "m": m,
        "default": default["config"],
        "default_us": default.get("us"),
        "best": best and best["config"],
        "best_us": best and best["us"],
        "gain": best and default.get("us") and default["us"] / best["us"],
        "configs": results,
    }


def decode_totals(rows: list[dict]) -> list[dict]:
    """Per M: one decode step's linears (``PER_STEP`` calls of each shape)."""
    totals = []
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        if len(at_m) != len(SHAPES) or any("triton_us" not in r for r in at_m):
            continue
        total = {"m": m}
        for key in ("floor_us", "cublas_us", "triton_us"):
            total[key] = sum(PER_STEP[r["shape"]] * r[key] for r in at_m)
        total["cublas_x_floor"] = total["cublas_us"] / total["floor_us"]
        total["triton_x_floor"] = total["triton_us"] / total["floor_us"]
        total["speedup"] = total["cublas_us"] / total["triton_us"]
        totals.append(total)
    return totals


# ---- report ------------------------------------------------------------------------

ROW_COLUMNS = [("shape", "shape"), ("M", "m"), ("floor us", "floor_us"),
               ("cuBLAS us", "cublas_us"), ("x floor", "cublas_x_floor"),
               ("Triton us", "triton_us"), ("x floor", "triton_x_floor"),
               ("speed-up", "speedup"), ("ops uses", "ops_uses"),
               ("Triton tiles", "config")]  # fmt: skip
TOTAL_COLUMNS = [("M", "m"), ("floor us", "floor_us"), ("cuBLAS us", "cublas_us"),
                 ("x floor", "cublas_x_floor"), ("Triton us", "triton_us"),
                 ("x floor", "triton_x_floor"), ("speed-up", "speedup")]  # fmt: skip
SWEEP_COLUMNS = [("shape", "shape"), ("M", "m"), ("default", "default"),
                 ("us", "default_us"), ("best", "best"), ("us", "best_us"),
                 ("default / best", "gain")]  # fmt: skip


def show(title: str, columns: list[tuple[str, str]], rows: list[dict]) -> None:
    print(f"\n{title}\n")
    roofline.print_table(
        [h for h, _ in columns], [[r.get(key) for _, key in columns] for r in rows]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time a grid of tilings per shape")
    ap.add_argument("--quick", action="store_true", help="M in 1, 4, 16 and fewer repeats")
    ap.add_argument(
        "--json",
        nargs="?",
        const="",
        help="write the report (default path docs/perf/linear_<label>.json)",
    )
    ap.add_argument("--label", help="the device kind in the file name (default: the GPU name)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("linear_roofline needs a CUDA GPU")

    start = time.perf_counter()
    command = roofline.command_line("linear_roofline.py")
    name = torch.cuda.get_device_name()
    label = args.label or roofline.device_slug(name)
    timing = {"warmup": 3, "repeat": 10} if args.quick else {"warmup": 5, "repeat": 30}
    timing["flush_l2"] = True
    sweep_timing = {"warmup": 2, "repeat": 8, "flush_l2": True}
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    copy_gbps = roofline.copy_bandwidth_gbps(DEVICE)
    print(f"{name}, {num_sms} SMs: copy {copy_gbps:.0f} GB/s (read + write)")

    rows, sweeps = [], []
    for shape in args.shapes:
        ops = Operands(*SHAPES[shape])
        for m in ROWS_QUICK if args.quick else ROWS:
            try:
                rows.append(measure_row(shape, m, ops, copy_gbps, timing))
            except Exception as e:
                traceback.print_exc()
                rows.append({"shape": shape, "m": m, "error": f"{type(e).__name__}: {e}"})
        if args.sweep:
            for m in SWEEP_ROWS:
                sweeps.append(sweep_shape(shape, m, ops, num_sms, sweep_timing))
                print(f"  swept {shape} M={m}: best {sweeps[-1]['best']}", flush=True)
        del ops
        torch.cuda.empty_cache()

    show(
        f"bf16 linears of Qwen3-8B; floor: weight + x + out bytes at {copy_gbps:.0f} GB/s; "
        "x floor = time / floor",
        ROW_COLUMNS,
        rows,
    )
    for row in rows:
        if "error" in row:
            print(f"  not timed: {row['shape']} M={row['m']}: {row['error']}")
    totals = decode_totals(rows)
    show(f"One decode step's linears ({LAYERS} layers + LM head)", TOTAL_COLUMNS, totals)
    if sweeps:
        show("Sweep: default tiles against the best of the grid", SWEEP_COLUMNS, sweeps)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s")

    if args.json is not None:
        path = args.json or f"docs/perf/linear_{label}.json"
        report = {
            "benchmark": "linear_roofline",
            **roofline.environment(command),
            "device_kind": label,
            "num_sms": num_sms,
            "copy_gbps": copy_gbps,
            "timing": timing,
            "rows": rows,
            "decode_totals": totals,
            "sweep": sweeps,
            "seconds": elapsed,
        }
        roofline.write_report(Path(path), report)
        print(f"wrote {path}")
    errors = sum("error" in row for row in rows)
    if errors:
        raise SystemExit(f"{errors} row(s) not timed: see 'not timed' above")


if __name__ == "__main__":
    main()
