"""The fused MoE's decode tiles: each grouped GEMM's tiles swept on the decode shapes,
against the weight-bytes floor, to choose ``tuning.GpuTuning.moe_decode_tiles``.

    python benchmarks/moe_tiles.py [--json [PATH]] [--quick]

Shapes (bf16, routing drawn uniformly over the experts, so nearly every expert gets a
row; experts get at most 16 rows each, the regime the decode tiles serve):

- ``glm45-air-ep2``: one rank of GLM-4.5-Air's MoE on EP2 at 64 tokens a rank: 64 local
  experts of 1408 (hidden 4096), the 128 rows dispatch brings (its own 64 tokens and
  the other rank's), each choice held by the other rank an id of -1; a float32 part;
- ``glm45-air-b32``: the whole layer on one GPU (128 experts), 32 tokens;
- ``qwen3-30b-a3b-b64``: Qwen3-30B-A3B's MoE (128 experts of 768, hidden 2048), 64 tokens.

Each configuration runs ``fused_moe`` (alignment, both GEMMs, SiLU, the top-k sum)
replayed from a CUDA graph, as a decode step runs it; the floor is the weights of the
experts that got a row at the copy bandwidth measured in the same run. The sweep
changes one GEMM's tiles at a time, the other on the current default; the table gives
each shape's default and best, and ``best_common``: the pair of tiles whose worst
ratio to each shape's best is least (what one GPU entry can take).
"""

from __future__ import annotations

import argparse
import itertools

import torch

try:  # run as a script: benchmarks/ is on the path
    import roofline
except ImportError:  # imported as a module
    from benchmarks import roofline

from splitserve.kernels import tuning
from splitserve.kernels.triton.fused_moe import fused_moe
from splitserve.kernels.tuning import MoETiles, Tiles

DTYPE = torch.bfloat16
# name: (tokens, experts here, experts in all, hidden, intermediate, top_k, ranks)
SHAPES = {
    "glm45-air-ep2": (128, 64, 128, 4096, 1408, 8, 2),
    "glm45-air-b32": (32, 128, 128, 4096, 1408, 8, 1),
    "qwen3-30b-a3b-b64": (64, 128, 128, 2048, 768, 8, 1),
}
BLOCK_N, BLOCK_K, STAGES, WARPS = (32, 64, 128), (64, 128, 256), (3, 4, 5), (4, 8)
QUICK = {"BLOCK_N": (64, 128), "BLOCK_K": (64, 128, 256), "STAGES": (3, 4), "WARPS": (4,)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tiles")
    p.add_argument("--json", nargs="?", const="", default=None, help="write the report")
    args = p.parse_args()
    device = torch.device("cuda")
    copy_gbps = roofline.copy_bandwidth_gbps(device)
    default = tuning.for_device(device).moe_decode_tiles
    candidates = tile_candidates(args.quick)
    shapes = {name: Shape(name, *dims, device) for name, dims in SHAPES.items()}
    results = {name: {} for name in shapes}
    pairs = [default]
    pairs += [MoETiles(16, t, default.down) for t in candidates if t != default.gate_up]
    pairs += [MoETiles(16, default.gate_up, t) for t in candidates if t != default.down]
    for tiles in pairs:
        for name, shape in shapes.items():
            us = shape.time_us(tiles)
            if us is not None:
                results[name][key(tiles)] = us
    best_gate_up = best_of(results, pairs, "gate_up", default)
    best_down = best_of(results, pairs, "down", default)
    combined = MoETiles(16, best_gate_up, best_down)
    for name, shape in shapes.items():  # the two best together, measured
        results[name][key(combined)] = shape.time_us(combined)
    report(shapes, results, default, combined, copy_gbps, args)


class Shape:
    def __init__(self, name, tokens, local, total, hidden, inter, top_k, ranks, device):
        self.name, self.ranks = name, ranks
        g = torch.Generator(device).manual_seed(0)
        scores = torch.rand(tokens, total, generator=g, device=device)
        weights, ids = scores.softmax(dim=-1).topk(top_k, dim=-1)
        if local < total:  # rank 0's view: the other rank's choices are -1
            here = ids < local
            ids, weights = torch.where(here, ids, -1), torch.where(here, weights, 0.0)
        self.x = torch.randn(tokens, hidden, generator=g, device=device).to(DTYPE)
        self.w13 = (torch.randn(local, 2 * inter, hidden, generator=g, device=device) / 64).to(
            DTYPE
        )
        self.w2 = (torch.randn(local, hidden, inter, generator=g, device=device) / 38).to(DTYPE)
        self.ids, self.weights = ids, weights
        hit = int(torch.unique(ids[ids >= 0]).numel())
        self.weight_bytes = hit * 3 * hidden * inter * DTYPE.itemsize
        self.reference = None

    def run(self, tiles: MoETiles) -> torch.Tensor:
        return fused_moe(
            self.x, self.w13, self.w2, self.weights, self.ids, skip_negative_ids=True,
            out_dtype=torch.float32 if self.ranks > 1 else None, tiles=tiles,
        )  # fmt: skip

    def time_us(self, tiles: MoETiles) -> float | None:
        """Median microseconds of a graph replay; None where the tiles do not fit."""
        try:
            out = self.run(tiles)
        except Exception as exc:  # out of shared memory or registers: not a candidate
            if "out of resource" not in str(exc).lower():
                raise
            return None
        if self.reference is None:
            self.reference = out.float()
        err = float((out.float() - self.reference).abs().max() / self.reference.abs().max())
        if not err < 1e-2:
            raise SystemExit(f"{self.name} {key(tiles)}: relative error {err:.3g}")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(tiles)
        return roofline.time_cuda_ms(graph.replay, warmup=3, repeat=30) * 1e3


def tile_candidates(quick: bool) -> list[Tiles]:
    grid = QUICK if quick else {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "STAGES": STAGES}
    warps = grid.get("WARPS", WARPS)
    found = []
    for n, k, stages, w in itertools.product(
        grid["BLOCK_N"], grid["BLOCK_K"], grid["STAGES"], warps
    ):
        if w == 8 and n < 64:
            continue
        found.append(Tiles(n, k, stages, w))
    return found


def key(tiles: MoETiles) -> str:
    def one(t: Tiles) -> str:
        return f"{t.block_n}x{t.block_k}/s{t.num_stages}/w{t.num_warps}"

    return f"m{tiles.block_m} gate_up {one(tiles.gate_up)} down {one(tiles.down)}"


def best_of(results: dict, pairs: list[MoETiles], gemm: str, default: MoETiles) -> Tiles:
    """The tiles of ``gemm`` whose worst ratio to each shape's best time is least."""
    other = "down" if gemm == "gate_up" else "gate_up"
    swept = [t for t in pairs if getattr(t, other) == getattr(default, other)]

    def worst(tiles: MoETiles) -> float:
        ratios = []
        for times in results.values():
            mine = times.get(key(tiles))
            if mine is None:
                return float("inf")
            ratios.append(mine / min(times[key(t)] for t in swept if key(t) in times))
        return max(ratios)

    return getattr(min(swept, key=worst), gemm)


def report(shapes, results, default, combined, copy_gbps, args) -> None:
    rows = []
    for name, shape in shapes.items():
        floor_us = shape.weight_bytes / copy_gbps / 1e3
        times = results[name]
        best = min(times, key=times.get)
        for label, tiles_key in (
            ("default", key(default)),
            ("best", best),
            ("chosen", key(combined)),
        ):
            us = times[tiles_key]
            rows.append([name, label, tiles_key, us, floor_us, us / floor_us])
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; bf16; random routing (uniform over the experts)")
    roofline.print_table(["shape", "tiles", "which", "us", "floor us", "x floor"], rows)
    if args.json is not None:
        env = roofline.environment(roofline.command_line("moe_tiles.py"))
        path = args.json or f"docs/perf/moe_tiles_{roofline.device_slug(env['device'])}.json"
        payload = {
            **env,
            "copy_gbps": copy_gbps,
            "default": key(default),
            "chosen": key(combined),
            "chosen_tiles": {"gate_up": vars(combined.gate_up), "down": vars(combined.down)},
            "shapes": {
                name: {"weight_bytes": s.weight_bytes, "us": results[name]}
                for name, s in shapes.items()
            },
        }
        roofline.write_report(path, payload)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
