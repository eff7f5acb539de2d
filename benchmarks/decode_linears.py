"""A decode step's linears replayed from one CUDA graph: cuBLAS against the Triton kernel.

    python benchmarks/decode_linears.py [--rows 1 8 16 32 64] [--json [PATH]] [--label KIND]

``linear_roofline.py`` times each projection alone, with L2 emptied before it;
a decode step runs them back to back, where a launch and a ramp-up can hide
behind the previous kernel's tail (and, with programmatic dependent launch,
the next kernel's programs are already resident). Here each projection of the
Qwen3-8B shape (qkv, o, gate_up, down) gets ``LAYERS`` weights of its own, and
the ``LAYERS`` calls of one projection, or the whole step's ``4 * LAYERS``, are
captured in one CUDA graph and replayed (L2 emptied before each replay). Per M:

- cuBLAS (``F.linear``);
- the Triton kernel with its default tiles, with PDL off and on;
- the Triton kernel with each tiling of ``CANDIDATES`` (PDL on), per projection;
  the step is then replayed with each projection's best.

Floor: the weights' bytes at the copy bandwidth measured in the same run. ``--json``
writes ``docs/perf/decode_linears_<label>.json``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

try:  # run as a script: benchmarks/ is on the path
    import roofline
    from linear_roofline import DTYPE, LAYERS, describe, rel_err
except ImportError:  # imported as a module
    from benchmarks import roofline
    from benchmarks.linear_roofline import DTYPE, LAYERS, describe, rel_err

from splitserve.kernels.triton import pdl
from splitserve.kernels.triton.linear import LinearConfig, default_config, small_m_linear

PROJECTIONS = {  # name: (N, K) of the weight
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
}
ROWS = [1, 8, 16, 32, 64]
# tl.dot tilings tried at M > 1: (block_n, block_k, split_k, num_warps, num_stages)
CANDIDATES = [
    (32, 128, 1, 4, 4),
    (64, 128, 1, 4, 4),
    (32, 128, 2, 4, 4),
    (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 4),
    (32, 64, 2, 4, 6),
    (64, 256, 1, 8, 3),
]
TOLERANCE = 2e-2

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Weights:
    """``LAYERS`` bf16 weights per projection and one x per (projection, M)."""

    def __init__(self, rows: list[int]):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.w = {
            name: [
                (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(DTYPE)
                for _ in range(LAYERS)
            ]
            for name, (n, k) in PROJECTIONS.items()
        }
        self.x = {
            (name, m): torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            for name, (_, k) in PROJECTIONS.items()
            for m in rows
        }

    def nbytes(self, names) -> int:
        return sum(w.numel() * w.element_size() for name in names for w in self.w[name])


def replay_ms(calls: list[Callable[[], object]]) -> float:
    """Median ms of one replay of ``calls`` captured in one graph, L2 emptied before each."""
    return roofline.time_cuda_ms_back_to_back(calls, warmup=3, repeat=15) * len(calls)


def step_calls(weights: Weights, m: int, linear_for: Callable[[str], Linear], names) -> list:
    """The graph's calls: layer by layer, each projection of ``names`` once."""
    return [
        functools.partial(linear_for(name), weights.x[name, m], weights.w[name][layer])
        for layer in range(LAYERS)
        for name in names
    ]


def triton(cfg: LinearConfig | None) -> Linear:
    return lambda x, w: small_m_linear(x, w, None, cfg)


def checked(name: str, fn: Linear, weights: Weights, m: int) -> bool:
    x, w = weights.x[name, m], weights.w[name][0]
    return rel_err(fn(x, w).float(), x.float() @ w.float().T) <= TOLERANCE


def measure_rows(weights: Weights, m: int, gbps: float) -> dict:
    names = list(PROJECTIONS)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    floor = weights.nbytes(names) / gbps / 1e6
    row = {"m": m, "floor_ms": round(floor, 4)}
    row["cublas_ms"] = replay_ms(step_calls(weights, m, lambda _: F.linear, names))
    for on in (False, True):
        pdl.set_enabled(on)
        key = f"triton_default_pdl_{'on' if on else 'off'}_ms"
        row[key] = replay_ms(step_calls(weights, m, lambda _: triton(None), names))
    best = {}
    for name in names:
        n, k = PROJECTIONS[name]
        configs = [default_config(m, n, k, num_sms)]
        if m > 1:
            configs += [LinearConfig(bn, bk, s, w, st) for bn, bk, s, w, st in CANDIDATES]
        times = {}
        for cfg in dict.fromkeys(configs):
            if k % cfg.block_k or not checked(name, triton(cfg), weights, m):
                continue
            times[cfg] = replay_ms(step_calls(weights, m, lambda _, c=cfg: triton(c), [name]))
        cublas = replay_ms(step_calls(weights, m, lambda _: F.linear, [name]))
        cfg = min(times, key=times.get)
        best[name] = cfg
        row[name] = {
            "floor_ms": round(weights.nbytes([name]) / gbps / 1e6, 4),
            "cublas_ms": cublas,
            "best": describe(cfg),
            "best_ms": times[cfg],
            "default_ms": times[configs[0]],
            "configs": {describe(c): t for c, t in times.items()},
        }
    row["triton_best_ms"] = replay_ms(
        step_calls(weights, m, lambda name: triton(best[name]), names)
    )
    for key in ("cublas_ms", "triton_default_pdl_off_ms", "triton_default_pdl_on_ms"):
        row[key.replace("_ms", "_x_floor")] = row[key] / floor
    row["triton_best_x_floor"] = row["triton_best_ms"] / floor
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--json", nargs="?", const="", help="write the report (default path)")
    ap.add_argument("--label", help="the device kind in the file name (default: the GPU name)")
    args = ap.parse_args()
    start = time.perf_counter()
    gbps = roofline.copy_bandwidth_gbps("cuda")
    weights = Weights(args.rows)
    rows = []
    for m in args.rows:
        rows.append(measure_rows(weights, m, gbps))
        r = rows[-1]
        per = ", ".join(
            f"{n} {r[n]['best']} {r[n]['best_ms']:.3f} (cuBLAS {r[n]['cublas_ms']:.3f}, "
            f"floor {r[n]['floor_ms']:.3f})"
            for n in PROJECTIONS
        )
        print(f"M={m}: {per}", flush=True)
    print(f"\nDecode linears of {LAYERS} layers in one CUDA graph, ms (x floor); {gbps:.0f} GB/s")
    columns = ["M", "floor", "cuBLAS", "Triton default, PDL off", "PDL on", "Triton best, PDL on"]
    table = [
        [r["m"], r["floor_ms"]]
        + [
            f"{r[k + '_ms']:.3f} ({r[k + '_x_floor']:.2f})"
            for k in ("cublas", "triton_default_pdl_off", "triton_default_pdl_on", "triton_best")
        ]
        for r in rows
    ]
    roofline.print_table(columns, table)
    if args.json is not None:
        report = {
            **roofline.environment(roofline.command_line("decode_linears.py")),
            "copy_gbps": round(gbps, 1),
            "layers": LAYERS,
            "rows": rows,
            "seconds": round(time.perf_counter() - start, 1),
        }
        label = args.label or roofline.device_slug(report["device"])
        path = args.json or f"docs/perf/decode_linears_{label}.json"
        roofline.write_report(path, report)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
