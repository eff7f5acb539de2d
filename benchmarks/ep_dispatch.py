"""Expert-parallel dispatch + combine on N GPUs (``--ranks``, 2 by default), against the
byte floor; an EP-N MoE decode layer against its weight-bytes floor.

    python benchmarks/ep_dispatch.py [--ranks 2] [--tokens 1 2 4 ... 256] [--hidden 4096]
        [--top-k 8] [--experts 128] [--layer-batch 64] [--json [PATH]] [--device cpu]

N ranks, a process per GPU (spawned here), join a group as an engine's ranks do
(``workers/parallel/group.py``: NCCL for the data). Measured in the same run:

- peer bandwidth: an equal-split all-to-all of 256 MiB a rank; ``(N - 1) / N`` of it
  leaves the rank while as much comes in, so the rate is ``bytes leaving a rank /
  time``;
- copy bandwidth (``roofline.copy_bandwidth_gbps``), the layer floor's denominator.

Per tokens-a-rank T (top-k routing drawn uniformly over the experts):

- ``prefill`` mode: dispatch + combine, eager, the counts exchange's host wait
  included;
- ``decode`` mode: dispatch + combine at capacity T, captured in one CUDA graph and
  replayed, over NCCL (``decode``) and through the ranks' shared buffers (``peer``:
  ``workers/parallel/peer_memory.py``, GPUs that reach each other; what the engine
  takes there).

Floor: the bytes that must leave a rank (each token once to each other rank that holds
one of its choices, packed: hidden, ids, weights; and its partial sum coming back, in
``dispatch.PART_DTYPE``) at the peer bandwidth.
DECODE mode moves its whole capacity (``sent MiB``); ``all-to-alls us`` is its two
exchanges alone on buffers of its sizes (what the packing and summing add is the
difference). Times are the slower rank's.

The layer: GLM-4.5-Air's MoE (hidden 4096, 128 routed experts of 1408, top-8 of one
group, one shared expert), ``--layer-batch`` tokens a rank, EP-N in DECODE mode: router,
dispatch, the rank's 128 / N experts, combine, shared expert, replayed from one CUDA graph,
through the shared buffers and over NCCL.
Floor: the weights it reads (its experts that got a token, the shared expert, the
router) at the copy bandwidth. ``--json`` writes ``docs/perf/ep_dispatch_<device>.json``.
``--device cpu`` runs the same code over gloo (small sizes: a check, not a measurement).
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:  # run as a script: benchmarks/ is on the path
    import roofline
except ImportError:  # imported as a module
    from benchmarks import roofline

from splitserve.kernels.ep_rows import RowLayout
from splitserve.workers.model.layers.moe import GroupedTopKRouter, MoEBlock
from splitserve.workers.parallel.dispatch import (
    PART_DTYPE,
    Dispatcher,
    DispatchMode,
    MoEDispatch,
)
from splitserve.workers.parallel.group import (
    attach_dispatcher,
    expert_shard,
    free_address,
    join_group,
)
from splitserve.workers.parallel.peer_memory import PeerLayout, PeerMemory, peers_reachable
from splitserve.workers.runner.step_plan import StepPlan

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PEER_PROBE_BYTES = 256 << 20
DTYPE = torch.bfloat16
LAYER = {"hidden": 4096, "experts": 128, "intermediate": 1408, "top_k": 8, "shared": 1408}
TARGETS = {"decode_us_at_128": 60.0, "layer_over_floor": 1.3}  # EP2 over NVLink


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="expert-parallel size")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--layer-batch", type=int, default=64)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", nargs="?", const="", default=None, help="write the report")
    args = p.parse_args()
    if args.experts % args.ranks or LAYER["experts"] % args.ranks:
        raise SystemExit(f"--ranks {args.ranks} must divide the experts ({args.experts})")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, this host has {torch.cuda.device_count()}")
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(free_address(), vars(args), results), nprocs=args.ranks)
    report(results.get(), args)


def rank_main(rank: int, address: str, args: dict, results) -> None:
    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = join_group(rank, args["ranks"], address, device)
    bench = Bench(group, device, cuda, args["ranks"])
    peer_gbps = bench.slowest(bench.peer_bandwidth_gbps(), larger_is_slower=False)
    copy_gbps = roofline.copy_bandwidth_gbps(device) if cuda else None
    bench.peers = bench.shared_buffers(max(args["tokens"]), args)
    rows = [bench.dispatch_row(t, args, peer_gbps) for t in args["tokens"]]
    layer = bench.layer_row(args["layer_batch"], copy_gbps)
    if rank == 0:
        results.put({"peer_gbps": peer_gbps, "copy_gbps": copy_gbps, "rows": rows, "layer": layer})
    group.control.barrier().wait()
    group.close()


class Bench:
    def __init__(self, group, device: torch.device, cuda: bool, ranks: int):
        self.group, self.device, self.cuda, self.ranks = group, device, cuda, ranks
        self.peers = None

    def shared_buffers(self, max_tokens: int, args: dict):
        """The ranks' shared buffers for up to ``max_tokens`` a rank (GPUs that reach each
        other; None elsewhere)."""
        if not self.cuda:
            return None
        if not peers_reachable(self.group.control, self.group.rank, self.ranks, self.device):
            return None
        row = RowLayout(args["hidden"], args["top_k"], DTYPE)
        layout = PeerLayout(self.ranks, max_tokens, row)
        self.group.peers = PeerMemory(self.group.control, self.group.rank, layout, self.device)
        return self.group.peers

    # -- timing ------------------------------------------------------------------------

    def time_us(self, fn, repeat: int = 50) -> float:
        """Median microseconds of ``fn`` on this rank (CUDA events on a GPU)."""
        if self.cuda:
            return roofline.time_cuda_ms(fn, warmup=5, repeat=repeat) * 1e3
        for _ in range(3):
            fn()
        spans = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            spans.append(time.perf_counter() - start)
        return median(spans) * 1e6

    def slowest(self, value: float, larger_is_slower: bool = True) -> float:
        """The slower rank's figure (the group waits for it)."""
        mine = torch.tensor([value], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.ranks)]
        self.group.control.allgather([every], [mine]).wait()
        values = [float(v) for v in every]
        return max(values) if larger_is_slower else min(values)

    def graphed(self, fn):
        """``fn`` captured in a CUDA graph (GPU), as a decode step runs it; the output."""
        if not self.cuda:
            return fn, fn()
        fn()  # warm-up: communicators, kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph.replay, out

    # -- measurements ------------------------------------------------------------------

    def peer_bandwidth_gbps(self) -> float:
        nbytes = PEER_PROBE_BYTES if self.cuda else 8 << 20
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        opts = dist.AllToAllOptions()
        us = self.time_us(lambda: self.group.data.alltoall_base(dst, src, [], [], opts).wait())
        leaving = nbytes * (self.ranks - 1) / self.ranks
        return leaving / us / 1e3  # GB/s out of one rank (as much comes in)

    def dispatch_row(self, tokens: int, args: dict, peer_gbps: float) -> dict:
        hidden, top_k, experts = args["hidden"], args["top_k"], args["experts"]
        n, rank = self.ranks, self.group.rank
        dispatcher = Dispatcher(self.group.data, rank, n, experts // n)
        x, weights, ids = self.routed(tokens, hidden, top_k, experts, seed=tokens)
        layout = RowLayout(hidden, top_k, DTYPE)
        owner = ids // (experts // n)
        # (token, other rank holding one of its choices): the packed rows that leave
        sent = [(owner == r).any(dim=1) for r in range(n) if r != rank]
        crossing = int(torch.stack(sent).sum()) if sent else 0
        crossing = max(crossing, int(self.slowest(crossing)))
        part = dispatcher.part_dtype  # what the experts' sums travel back in
        back_bytes = hidden * part.itemsize
        floor_bytes = crossing * (layout.bytes + back_bytes)
        row = {"tokens": tokens, "floor_us": floor_bytes / peer_gbps / 1e3}
        ways = [("prefill", DispatchMode.PREFILL, None), ("decode", DispatchMode.DECODE, None)]
        if self.peers is not None:
            ways.append(("peer", DispatchMode.DECODE, self.peers))
        for name, mode, peers in ways:
            step = MoEDispatch(mode, tokens)
            dispatcher.peers = peers

            def both(step=step):
                got = dispatcher.dispatch(x, weights, ids, step)
                return dispatcher.combine(got.hidden.to(part), got)  # experts: the identity

            run = self.graphed(both)[0] if mode == DispatchMode.DECODE else both
            row[f"{name}_us"] = self.slowest(self.time_us(run))
        if self.peers is not None:  # the two ways bring the same sums
            dispatcher.peers = None
            nccl = both()
            dispatcher.peers = self.peers
            row["peer_equal"] = bool(self.slowest(float(torch.equal(both(), nccl)), False))
        row["all_to_all_us"] = self.slowest(self.time_us(self.bare_exchange(tokens, layout)))
        # DECODE mode sends its whole capacity (``tokens`` rows) to every other rank
        row["decode_sent_mib"] = (n - 1) * tokens * (layout.bytes + back_bytes) / 2**20
        row["floor_mib"] = floor_bytes / 2**20
        return row

    def bare_exchange(self, tokens: int, layout: RowLayout):
        """DECODE mode's two all-to-alls alone, on buffers of its sizes (graphed)."""
        opts = dist.AllToAllOptions()
        send = torch.zeros(self.ranks * tokens, layout.bytes, dtype=torch.uint8, device=self.device)
        part = PART_DTYPE
        sums = torch.zeros(self.ranks * tokens, layout.hidden, dtype=part, device=self.device)
        got, back = torch.empty_like(send), torch.empty_like(sums)

        def exchange():
            self.group.data.alltoall_base(got, send, [], [], opts).wait()
            self.group.data.alltoall_base(back, sums, [], [], opts).wait()

        return self.graphed(exchange)[0]

    def routed(self, tokens: int, hidden: int, top_k: int, experts: int, seed: int):
        g = torch.Generator(self.device).manual_seed(1000 * seed + self.group.rank)
        x = torch.randn(tokens, hidden, generator=g, device=self.device).to(DTYPE)
        scores = torch.rand(tokens, experts, generator=g, device=self.device)
        weights, ids = scores.softmax(dim=-1).topk(top_k, dim=-1)
        return x, weights, ids

    def layer_row(self, batch: int, copy_gbps: float | None) -> dict:
        c = LAYER if self.cuda else {**LAYER, "hidden": 256, "intermediate": 64, "shared": 64}
        h, e, i, k = c["hidden"], c["experts"], c["intermediate"], c["top_k"]
        shard = expert_shard(self.group.rank, self.ranks, e)
        with torch.device(self.device):
            torch.set_default_dtype(DTYPE)
            router = GroupedTopKRouter(h, e, k, 1, 1, True, 1.0)
            block = MoEBlock(router, e, h, i, c["shared"], shard=shard)
            torch.set_default_dtype(torch.float32)
        g = torch.Generator(self.device).manual_seed(3)
        for param in block.parameters():
            param.data.normal_(0.0, 0.02, generator=g)
        block.requires_grad_(False)
        attach_dispatcher(block, self.group)  # the shared buffers where the group has them
        x = torch.randn(batch, h, generator=g, device=self.device).to(DTYPE)
        slots = torch.arange(batch, device=self.device)  # every row live
        plan = StepPlan(moe_dispatch=MoEDispatch(DispatchMode.DECODE, batch, slots))
        dispatcher = block.experts.dispatcher
        times = {}
        with torch.inference_mode():
            block.experts.tokens_per_expert.zero_()
            block.on_normed(x, plan)
            hit = int((block.experts.tokens_per_expert > 0).sum())
            for name, peers in (("nccl", None), ("peer", self.peers)):
                if name == "peer" and peers is None:
                    continue
                dispatcher.peers = peers
                run, _ = self.graphed(lambda: block.on_normed(x, plan))
                times[name] = self.slowest(self.time_us(run))
        us = min(times.values())
        expert_bytes = 3 * h * i * DTYPE.itemsize
        weight_bytes = hit * expert_bytes + 3 * h * c["shared"] * DTYPE.itemsize
        weight_bytes += e * h * DTYPE.itemsize  # the router
        floor_us = weight_bytes / copy_gbps / 1e3 if copy_gbps else None
        return {
            "batch": batch,
            "experts_hit": hit,
            "weight_mib": weight_bytes / 2**20,
            "us": us,
            "nccl_us": times["nccl"],
            "peer_us": times.get("peer"),
            "floor_us": floor_us,
            "over_floor": us / floor_us if floor_us else None,
        }


def report(result: dict, args: argparse.Namespace) -> None:
    print(
        f"peer bandwidth {result['peer_gbps']:.1f} GB/s one way; copy bandwidth "
        f"{result['copy_gbps'] or 0:.0f} GB/s; hidden {args.hidden}, top-{args.top_k} of "
        f"{args.experts} experts, EP{args.ranks}",
        flush=True,
    )
    columns = ["tokens/rank", "prefill us", "decode us", "peer us", "all-to-alls us"]
    columns += ["floor us", "best/floor", "floor MiB", "decode sent MiB", "peer = nccl"]
    rows = []
    for r in result["rows"]:
        best = min(r["decode_us"], r.get("peer_us") or r["decode_us"])
        rows.append([
            r["tokens"], r["prefill_us"], r["decode_us"], r.get("peer_us"), r["all_to_all_us"],
            r["floor_us"], best / r["floor_us"] if r["floor_us"] else None, r["floor_mib"],
            r["decode_sent_mib"], r.get("peer_equal"),
        ])  # fmt: skip
    roofline.print_table(columns, rows)
    layer = result["layer"]
    roofline.print_table(
        ["MoE decode layer", "batch/rank", "experts hit", "weights MiB", "nccl us", "peer us",
         "floor us", "best x"],
        [
            [
                f"GLM-4.5-Air EP{args.ranks}", layer["batch"], layer["experts_hit"],
                layer["weight_mib"], layer["nccl_us"], layer["peer_us"], layer["floor_us"],
                layer["over_floor"],
            ]
        ],
    )  # fmt: skip
    if args.json is not None:
        env = roofline.environment(roofline.command_line("ep_dispatch.py"))
        path = args.json or f"docs/perf/ep_dispatch_{roofline.device_slug(env['device'])}.json"
        roofline.write_report(path, {**env, **result, "targets": TARGETS, "args": vars(args)})
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
