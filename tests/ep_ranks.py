"""What each rank of ``test_expert_parallel``'s dispatch test runs, in its own process
(a module light to import: ``torch.multiprocessing.spawn`` imports it in each)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import ops
from splitserve.kernels.ep_rows import RowLayout
from splitserve.kernels.fused_moe import fused_moe
from splitserve.workers.parallel.dispatch import Dispatcher, DispatchMode, MoEDispatch
from splitserve.workers.parallel.group import expert_shard, join_group
from splitserve.workers.parallel.peer_memory import PeerLayout, PeerMemory, peers_reachable

PREFILL, DECODE = DispatchMode.PREFILL, DispatchMode.DECODE

E, HIDDEN, INTER, TOP_K = 8, 32, 16, 2
GPU_EXPERTS = 16  # the GPU cases' routed experts


def _routing(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden, topk ids, KV slots or None) of ``rank``'s tokens in a dispatch case."""
    g = torch.Generator().manual_seed(100 * rank + len(case))
    num_tokens = {"random": 5 + 2 * rank, "to_rank1": 4, "idle_rank1": 4, "verify": 9}[case]
    experts = range(E // 2, E) if case in ("to_rank1", "verify") else range(E)
    choices = torch.tensor(list(experts))
    ids = torch.stack(
        [choices[torch.randperm(len(choices), generator=g)[:TOP_K]] for _ in range(num_tokens)]
    )
    slots = None
    if case == "idle_rank1" and rank == 1:  # an idle rank's one dummy row, KV slot -1
        ids, slots = ids[:1], torch.tensor([-1])
    return torch.randn(len(ids), HIDDEN, generator=g), ids, slots


def dispatch_cases(rank: int, address: str) -> None:
    group = join_group(rank, 2, address, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)  # the same experts on both ranks
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5
    shard = expert_shard(rank, 2, E)
    mine = slice(shard.first, shard.first + shard.count)
    dispatcher = Dispatcher(group.data, rank, 2, shard.count)
    for case, capacity in (("random", 7), ("to_rank1", 4), ("idle_rank1", 4), ("verify", 9)):
        x, ids, slots = _routing(case, rank)
        weights = torch.softmax(torch.randn(ids.shape), dim=-1)
        want = fused_moe(x, w13, w2, weights, ids)
        outs = {}
        for mode in (PREFILL, DECODE):
            got = dispatcher.dispatch(x, weights, ids, MoEDispatch(mode, capacity, slots))
            if mode == DECODE:  # shapes from the capacity alone
                assert got.hidden.shape == (2 * capacity, HIDDEN)
            elif case == "to_rank1" and rank == 0:
                assert got.hidden.shape[0] == 0  # nobody routes here
            elif case == "idle_rank1" and rank == 0:
                assert got.route.recv_splits[1] == 0  # the dummy row is not sent
            local = fused_moe(got.hidden, w13[mine], w2[mine], got.topk_weights, got.topk_ids)
            outs[mode] = dispatcher.combine(local, got)
        if slots is None:
            torch.testing.assert_close(outs[PREFILL], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(outs[PREFILL], outs[DECODE]), case
    if rank == 0:
        x, ids, _ = _routing("random", 0)
        with pytest.raises(ValueError, match="exceed the decode dispatch capacity"):
            dispatcher.dispatch(x, torch.ones(ids.shape), ids, MoEDispatch(DECODE, 2))
    group.control.barrier().wait()
    group.close()


def _new_tokens(x, ids, weights, slots, live: int, seed: int) -> None:
    """Random hidden states and routing over ``x``'s rows, the first ``live`` of them
    live (KV slot 0), the rest padding (slot -1)."""
    gen = torch.Generator(x.device).manual_seed(seed)
    x.copy_(torch.randn(x.shape, generator=gen, device=x.device))
    scores = torch.rand(x.shape[0], GPU_EXPERTS, generator=gen, device=x.device)
    w, i = torch.softmax(scores, dim=-1).topk(ids.shape[-1], dim=-1)
    ids.copy_(i)
    weights.copy_(w / w.sum(dim=-1, keepdim=True))
    slots.copy_(torch.where(torch.arange(x.shape[0], device=x.device) < live, 0, -1))


def graph_case(rank: int, address: str) -> None:
    """On GPU rank ``rank`` (NCCL): DECODE-mode dispatch, the local experts and combine
    captured in a CUDA graph and replayed on new tokens equal the eager layer (bitwise)
    and, in bf16, the whole MoE on one rank within 1e-2."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = join_group(rank, 2, address, device)
    g = torch.Generator(device).manual_seed(7)
    hidden, inter, experts, top_k, capacity = 1024, 512, GPU_EXPERTS, 4, 64
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / 32).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=device) / 22).bfloat16()
    shard = expert_shard(rank, 2, experts)
    mine = slice(shard.first, shard.first + shard.count)
    dispatcher = Dispatcher(group.data, rank, 2, shard.count)
    x = torch.zeros(capacity, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(capacity, top_k, dtype=torch.long, device=device)
    weights = torch.zeros(capacity, top_k, dtype=torch.float32, device=device)
    slots = torch.full((capacity,), -1, dtype=torch.long, device=device)
    step = MoEDispatch(DECODE, capacity, slots)

    def layer() -> torch.Tensor:
        got = dispatcher.dispatch(x, weights, ids, step)
        local = ops.fused_moe(
            got.hidden, w13[mine], w2[mine], got.topk_weights, got.topk_ids,
            skip_negative_ids=True, out_dtype=dispatcher.part_dtype,
        )  # fmt: skip
        return dispatcher.combine(local, got)

    layer()  # warm-up: the communicator, the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for n in (capacity, 17, 1, 0):  # live tokens; the rest padding (slot -1)
        _new_tokens(x, ids, weights, slots, n, seed=100 * rank + n)
        graph.replay()
        replayed = out[:n].clone()
        eager = layer()[:n]
        assert torch.equal(replayed, eager), n
        want = ops.fused_moe(x[:n], w13, w2, weights[:n], ids[:n]).float()
        if n:
            err = float((replayed.float() - want).norm() / want.norm())
            assert err < 1e-2, (n, err)
    del graph  # a graph holding NCCL's kernels keeps the group's shutdown waiting
    torch.cuda.synchronize()
    group.control.barrier().wait()
    group.close()


def peer_case(rank: int, address: str) -> None:
    """On GPU rank ``rank``: DECODE-mode dispatch and combine through the ranks' shared
    buffers equal the NCCL exchange bitwise, eagerly and replayed from a CUDA graph,
    padding rows and a rank with no tokens included; a step past the buffers' rows
    swaps over NCCL."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = join_group(rank, 2, address, device)
    hidden, inter, experts, top_k, capacity = 1024, 512, GPU_EXPERTS, 4, 64
    assert peers_reachable(group.control, rank, 2, device)
    layout = PeerLayout(2, capacity, RowLayout(hidden, top_k, torch.bfloat16))
    peers = PeerMemory(group.control, rank, layout, device)
    g = torch.Generator(device).manual_seed(7)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / 32).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=device) / 22).bfloat16()
    shard = expert_shard(rank, 2, experts)
    mine = slice(shard.first, shard.first + shard.count)
    nccl = Dispatcher(group.data, rank, 2, shard.count)
    shared = Dispatcher(group.data, rank, 2, shard.count, peers)
    x = torch.zeros(capacity, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(capacity, top_k, dtype=torch.long, device=device)
    weights = torch.zeros(capacity, top_k, dtype=torch.float32, device=device)
    slots = torch.full((capacity,), -1, dtype=torch.long, device=device)

    def layer(dispatcher: Dispatcher, step: MoEDispatch) -> torch.Tensor:
        got = dispatcher.dispatch(x, weights, ids, step)
        assert got.route.peers == (dispatcher is shared and step.capacity <= capacity)
        local = ops.fused_moe(
            got.hidden, w13[mine], w2[mine], got.topk_weights, got.topk_ids,
            skip_negative_ids=True, out_dtype=dispatcher.part_dtype,
        )  # fmt: skip
        return dispatcher.combine(local, got)

    step = MoEDispatch(DECODE, capacity, slots)
    layer(shared, step)  # warm-up: the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(shared, step)
    for n in (capacity, 17, 1, 0) if rank == 0 else (capacity, 5, 0, 0):
        _new_tokens(x, ids, weights, slots, n, seed=100 * rank + n)
        want = layer(nccl, step)[:n]
        assert torch.equal(layer(shared, step)[:n], want), ("eager", n)
        graph.replay()
        assert torch.equal(out[:n], want), ("replay", n)
    wide = MoEDispatch(DECODE, 2 * capacity, None)  # past the buffers: over NCCL
    assert torch.equal(layer(shared, wide), layer(nccl, wide))
    group.control.barrier().wait()
    peers.close()
    group.close()
