"""The split-KV decode kernel's tiles: swept on long-context decode shapes, bf16 and FP8
caches, against the KV-bytes floor, to choose ``tuning.GpuTuning.split_kv_tiles`` and
``split_kv_fp8_tiles``.

    python benchmarks/decode_tiles.py [--json [PATH]] [--quick] [--shapes ...]
        [--layout scattered|sequential] [--tiles n128/s1/w2/f16 ...]

Qwen3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, block 16), random
KV in scattered blocks (``--layout sequential``: each request's blocks in a row, as a
fresh engine allocates them; FP8: N(0, 1) quantized with scales of 1/16), one layer's
call as a decode step makes it (the new K/V row stored too; int64 tables, lengths and
slots, as an eager step passes them, where decode graphs pass int32 tables and lengths;
the split count the kernel picks for the batch).
Shapes: 64 requests at 8k tokens each (one split: the shape of the FP8 target), 32 and
16 (two and four splits on an H200) and 8 (eight splits). Each configuration is
checked against the default tiles' output first (relative error below 2e-2; the report
also gives each one's error against the torch reference in float32) and timed with L2
emptied and the GPU held until the host has queued the call (``host_ahead``); the
floor is the KV, q and output bytes at the copy bandwidth measured in the same run.
Tiles: tokens a tile, pipeline stages, warps, and for FP8 whether tiles and q go to
float16 for the products (``DecodeTiles``). FP8 also times the tensor-core CUDA kernel
(``kernels/fp8_decode_cuda.py``, keys ``cuda/w<warps>/s<stages>/b<blocks an SM>``,
``FP8DecodeTiles``) with the Triton store of the new rows before it, as the engine
runs it. Each case's SM clock while its tilings ran (``gpu_clocks.py``) is printed and
in the JSON. ``--tiles`` times only the tilings named (the first is the reference), e.g.
under Nsight Compute:
``ncu --set full -k regex:_split_kernel -s 2 -c 1 python benchmarks/decode_tiles.py
--shapes b64x8k --dtypes fp8 --tiles n128/s1/w2/f16``.
"""

from __future__ import annotations

import argparse
import itertools
import re

import torch

try:  # run as a script: benchmarks/ is on the path
    import roofline
    from gpu_clocks import ClockProbe, describe
except ImportError:  # imported as a module
    from benchmarks import roofline
    from benchmarks.gpu_clocks import ClockProbe, describe

from splitserve.kernels import tuning
from splitserve.kernels.decode_attention import decode_attention as reference_attention
from splitserve.kernels.fp8_decode_cuda import FP8DecodeKernel
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.triton.decode_attention import decode_attention
from splitserve.kernels.triton.kv_store import store_kv_fp8
from splitserve.kernels.tuning import DecodeTiles, FP8DecodeTiles

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
SHAPES = {"b64x8k": (64, 8192), "b32x8k": (32, 8192), "b16x8k": (16, 8192), "b8x8k": (8, 8192)}
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
GRID = {"block_n": (64, 128, 256), "num_stages": (1, 2, 3, 4), "num_warps": (2, 4, 8)}
QUICK = {"block_n": (64, 128), "num_stages": (1, 3), "num_warps": (2, 4)}
CUDA_GRID = {"warps": (4, 8), "stages": (2, 3, 4), "blocks_per_sm": (1.0, 2.0, 4.0)}
CUDA_QUICK = {"warps": (8,), "stages": (2, 3), "blocks_per_sm": (2.0, 4.0)}
LAYOUTS = ("scattered", "sequential")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tiles")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layout", choices=LAYOUTS, default="scattered", help="requests' blocks")
    p.add_argument("--json", nargs="?", const="", default=None, help="write the report")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--tiles", nargs="+", type=parse_key, help="only these tilings")
    args = p.parse_args()
    device = torch.device("cuda")
    copy_gbps = roofline.copy_bandwidth_gbps(device)
    tuned = tuning.for_device(device)
    defaults = {"bf16": tuned.split_kv_tiles, "fp8": tuned.split_kv_fp8_tiles}
    results: dict[str, dict[str, dict[str, float]]] = {}
    floors: dict[str, dict[str, float]] = {}
    errors: dict[str, dict[str, dict[str, float]]] = {}
    clocks: dict[str, dict[str, dict]] = {}  # the SM clock while a case's tilings ran
    for (name, (batch, context)), kv in itertools.product(
        ((n, SHAPES[n]) for n in args.shapes), args.dtypes
    ):
        case = Case(batch, context, DTYPES[kv], device, args.layout)
        floors.setdefault(name, {})[kv] = case.bytes / copy_gbps / 1e3
        times = results.setdefault(name, {}).setdefault(kv, {})
        with ClockProbe(device.index or 0) as probe:
            for tiles in args.tiles or [defaults[kv], *candidates(kv, args.quick)]:
                if key(tiles) not in times:
                    us = case.time_us(tiles)
                    if us is not None:
                        times[key(tiles)] = us
                        print(f"{name} {kv} {key(tiles)}: {us:.1f} us", flush=True)
        clocks.setdefault(name, {})[kv] = summary = probe.summary()
        print(f"{name} {kv}: {describe(summary)}", flush=True)
        errors.setdefault(name, {})[kv] = case.errors
        del case
        torch.cuda.empty_cache()
    report(results, floors, errors, clocks, defaults, copy_gbps, args)


class Case:
    """One layer's cache of ``batch`` requests of ``context`` tokens, and a step's inputs."""

    def __init__(self, batch, context, dtype, device, layout: str):
        g = torch.Generator(device).manual_seed(0)
        per_seq = context // BLOCK + 1
        blocks = batch * per_seq + 1
        shape = (blocks, BLOCK, KV_HEADS, DIM)
        self.k_cache, self.v_cache = (torch.empty(shape, dtype=dtype, device=device) for _ in "kv")
        for t in (self.k_cache, self.v_cache):
            for chunk in t.split(4096):
                x = torch.randn(chunk.shape, generator=g, device=device, dtype=torch.bfloat16)
                chunk.copy_(x * 16 if dtype == FP8_DTYPE else x)
        if layout == "scattered":
            order = torch.randperm(blocks - 1, generator=g, device=device) + 1
        else:  # each request's blocks one after another, as a fresh engine allocates them
            order = torch.arange(1, blocks, device=device)
        self.tables = order[: batch * per_seq].view(batch, per_seq).to(torch.int64)
        self.lens = torch.full((batch,), context + 1, dtype=torch.int64, device=device)
        self.slots = self.tables[:, context // BLOCK] * BLOCK + context % BLOCK
        self.q, self.k, self.v = (
            torch.randn(batch, n, DIM, generator=g, device=device, dtype=torch.bfloat16)
            for n in (HEADS, KV_HEADS, KV_HEADS)
        )
        one = torch.full((1,), 1 / 16, device=device)
        self.scales = (one, one.clone()) if dtype == FP8_DTYPE else None
        kv_bytes = batch * (context + 1) * 2 * KV_HEADS * DIM * dtype.itemsize
        self.bytes = kv_bytes + 2 * batch * HEADS * DIM * 2
        self.reference: torch.Tensor | None = None
        self.torch_out: torch.Tensor | None = None
        self.errors: dict[str, float] = {}  # tiles -> relative error against torch

    def run(self, tiles: DecodeTiles | FP8DecodeTiles) -> torch.Tensor:
        if isinstance(tiles, FP8DecodeTiles):  # the new rows stored first, as the engine does
            store_kv_fp8(self.k, self.v, self.k_cache, self.v_cache, self.slots, *self.scales,
                         calibrated=True)  # fmt: skip
            return FP8DecodeKernel(tiles)(
                self.q, self.k_cache, self.v_cache, self.tables, self.lens, DIM**-0.5,
                self.scales,
            )  # fmt: skip
        return decode_attention(
            self.q, self.k_cache, self.v_cache, self.tables, self.lens, DIM**-0.5,
            new_kv=(self.k, self.v, self.slots), kv_scales=self.scales, tiles=tiles,
        )  # fmt: skip

    def time_us(self, tiles: DecodeTiles) -> float | None:
        """Median microseconds of one call; None where the tiles do not fit."""
        try:
            out = self.run(tiles).float()
        except Exception as exc:  # out of shared memory or registers: not a candidate
            if "out of resource" not in str(exc).lower():
                raise
            return None
        if self.reference is None:
            self.reference = out
        err = float((out - self.reference).abs().max() / self.reference.abs().max())
        if not err < 2e-2:
            raise SystemExit(f"{key(tiles)}: relative error {err:.3g} against the default")
        self.errors[key(tiles)] = self.torch_error(out)
        ms = roofline.time_cuda_ms(
            lambda: self.run(tiles), repeat=20, flush_l2=True, host_ahead=True
        )
        return ms * 1e3

    def torch_error(self, out: torch.Tensor) -> float:
        """Relative max error of ``out`` against the torch reference in float32 (computed
        once: it stores the same new rows, so the cache stays as it was)."""
        if self.torch_out is None:
            self.torch_out = reference_attention(
                self.q.float(), self.k_cache, self.v_cache, self.tables, self.lens, DIM**-0.5,
                new_kv=(self.k, self.v, self.slots), kv_scales=self.scales,
            ).float()  # fmt: skip
        return float((out - self.torch_out).abs().max() / self.torch_out.abs().max())


def candidates(kv: str, quick: bool) -> list[DecodeTiles | FP8DecodeTiles]:
    grid = QUICK if quick else GRID
    f16 = (False, True) if kv == "fp8" else (False,)
    tiles: list[DecodeTiles | FP8DecodeTiles] = [
        DecodeTiles(n, s, w, f)
        for n, s, w, f in itertools.product(
            grid["block_n"], grid["num_stages"], grid["num_warps"], f16
        )
    ]
    if kv == "fp8":
        cuda = CUDA_QUICK if quick else CUDA_GRID
        tiles += [FP8DecodeTiles(*t) for t in itertools.product(*cuda.values())]
    return tiles


def key(tiles: DecodeTiles | FP8DecodeTiles) -> str:
    if isinstance(tiles, FP8DecodeTiles):
        return f"cuda/w{tiles.warps}/s{tiles.stages}/b{tiles.blocks_per_sm:g}"
    dot = "/f16" if tiles.fp8_f16_dot else ""
    return f"n{tiles.block_n}/s{tiles.num_stages}/w{tiles.num_warps}{dot}"


def parse_key(text: str) -> DecodeTiles | FP8DecodeTiles:
    """``key``'s inverse: ``n128/s1/w2/f16`` -> ``DecodeTiles(128, 1, 2, True)``,
    ``cuda/w8/s3/b2`` -> ``FP8DecodeTiles(8, 3, 2.0)``."""
    cuda = re.fullmatch(r"cuda/w(\d+)/s(\d+)/b([\d.]+)", text)
    if cuda is not None:
        w, s, b = cuda.groups()
        return FP8DecodeTiles(int(w), int(s), float(b))
    match = re.fullmatch(r"n(\d+)/s(\d+)/w(\d+)(/f16)?", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"tiles {text!r}: expected n<tokens>/s<stages>/w<warps>[/f16] or "
            "cuda/w<warps>/s<stages>/b<blocks an SM>"
        )
    n, s, w, f16 = match.groups()
    return DecodeTiles(int(n), int(s), int(w), fp8_f16_dot=f16 is not None)


def report(results, floors, errors, clocks, defaults, copy_gbps, args) -> None:
    rows = []
    for name, by_kv in results.items():
        for kv, times in by_kv.items():
            picks = [("default", key(defaults[kv])), ("best", min(times, key=times.get))]
            for label, tiles_key in (p for p in picks if p[1] in times):
                us, floor_us = times[tiles_key], floors[name][kv]
                err = errors[name][kv].get(tiles_key)
                rows.append([name, kv, label, tiles_key, us, floor_us, us / floor_us, err])
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; one layer's call; L2 emptied before each")
    columns = ["shape", "kv", "tiles", "which", "us", "floor us", "x floor", "err vs torch"]
    roofline.print_table(columns, rows)
    if args.json is not None:
        env = roofline.environment(roofline.command_line("decode_tiles.py"))
        path = args.json or f"docs/perf/decode_tiles_{roofline.device_slug(env['device'])}.json"
        payload = {
            **env,
            "copy_gbps": copy_gbps,
            "defaults": {kv: key(t) for kv, t in defaults.items()},
            "floor_us": floors,
            "us": results,
            "rel_error_vs_torch": errors,
            "clocks": clocks,
        }
        roofline.write_report(path, payload)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
