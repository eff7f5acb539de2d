"""What each rank of ``test_expert_parallel``'s dispatch test runs, in its own process
(a module light to import: ``torch.multiprocessing.spawn`` imports it in each)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.fused_moe import fused_moe
from splitserve.workers.parallel.dispatch import Dispatcher, DispatchMode, MoEDispatch
from splitserve.workers.parallel.group import expert_shard, join_group

PREFILL, DECODE = DispatchMode.PREFILL, DispatchMode.DECODE

E, HIDDEN, INTER, TOP_K = 8, 32, 16, 2


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
