"""Expert parallelism on CPU: two ranks in two processes over gloo.

Dispatch and combine in both modes against the whole MoE on one rank (random
routing, every token to one rank's experts, an idle rank, an MTP verify width);
the group's per-step choice (``agree``) for each role; and end to end, EP2 greedy
output of tiny Qwen3-MoE and GLM-4.5 checkpoints token-identical to EP1 and to
transformers, through prefill, decode and mixed steps, an idle rank, and a GLM
checkpoint whose routing sends every token to the other rank's experts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.workers.model.loader import load_hf_config
from splitserve.workers.parallel.dispatch import DispatchMode
from splitserve.workers.parallel.distribution import LeastLoaded
from splitserve.workers.parallel.group import (
    check_expert_parallel,
    free_address,
)
from splitserve.workers.parallel.lockstep import StepHeader, agree
from splitserve.workers.runner.forward_batch import ForwardBatch, Phase
from tests import checkpoints, ep_ranks
from tests.test_engine import _hf_greedy, _prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PREFILL, DECODE = DispatchMode.PREFILL, DispatchMode.DECODE

# ---- dispatch and combine, two real processes ------------------------------------------


def test_dispatch_and_combine_equal_the_whole_moe_in_both_modes():
    """Each rank's tokens through both modes equal the whole MoE on one rank (``ep_ranks.py``:
    random routing, every token to rank 1's experts, an idle rank, an MTP verify width
    that fills the capacity)."""
    mp.spawn(ep_ranks.dispatch_cases, args=(free_address(),), nprocs=2)


# ---- the group's choice, from every rank's header --------------------------------------

DEC, PRE, IDLE = StepHeader(4, True, True), StepHeader(20, False, False), StepHeader.idle()
SIZES = [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    ("role", "headers", "mode", "graph_size", "capacity"),
    [
        ("mixed", [DEC, DEC], DECODE, 4, 4),
        ("mixed", [DEC, IDLE], DECODE, 4, 4),  # an idle rank replays padding with the other
        ("mixed", [DEC, PRE], PREFILL, None, 20),  # rank 0 alone would have chosen DECODE
        ("mixed", [IDLE, PRE], PREFILL, None, 20),
        ("prefill", [DEC, DEC], PREFILL, None, 4),
        ("decode", [DEC, PRE], DECODE, None, 20),  # a local prompt: eager, capacity covers it
        ("decode", [StepHeader(3, True, True), StepHeader(9, True, True)], DECODE, 16, 16),
        ("decode", [StepHeader(17, True, True), DEC], DECODE, None, 17),  # above every size
        ("decode", [DEC, StepHeader(4, True, False)], DECODE, None, 4),  # one cannot replay
    ],
)
def test_every_rank_agrees_on_the_steps_mode_from_the_headers(
    role, headers, mode, graph_size, capacity
):
    for order in (headers, headers[::-1]):  # the same choice whichever rank is which
        step = agree(role, order, SIZES)
        assert (step.mode, step.graph_size, step.capacity) == (mode, graph_size, capacity)


def test_nobody_runs_when_no_rank_has_tokens():
    step = agree("mixed", [IDLE, IDLE], SIZES)
    assert not step.runs and step.mode is None


def test_least_loaded_placement():
    places = LeastLoaded(3)
    loads = [("a", 0), ("b", 1), ("c", 1), ("d", 1), ("e", 2)]  # (request, rank 0's load)
    assert [places.place(r, load) for r, load in loads] == [0, 1, 2, 0, 1]  # ties: lowest
    places.finished("b")
    assert places.place("f", 2) == 1 and places.rank_of == {"c": 2, "e": 1, "f": 1}


# ---- configuration -----------------------------------------------------------------------


def test_parallel_config_is_checked():
    assert EngineConfig.from_dict({"parallel": {"expert_parallel_size": 2}}).parallel == (
        EngineConfig().parallel.__class__(2)
    )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="parallel.expert_parallel_size"):
            EngineConfig.from_dict({"parallel": {"expert_parallel_size": bad}})
    with pytest.raises(ValueError, match="unknown config key 'parallel.expert_parallel'"):
        EngineConfig.from_dict({"parallel": {"expert_parallel": 2}})


def test_expert_parallel_size_must_fit_the_model_and_the_host(tmp_path):
    moe = load_hf_config("qwen3-moe-tiny")[0]  # 8 routed experts
    with pytest.raises(ValueError, match="does not divide the model's 8 routed experts"):
        check_expert_parallel(3, moe, torch.device("cpu"))
    with pytest.raises(ValueError, match="has no routed experts"):
        check_expert_parallel(2, load_hf_config("qwen3-tiny")[0], torch.device("cpu"))
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"this process sees {count} GPU"):
        check_expert_parallel(count + 2 - count % 2, moe, torch.device("cuda"))
    for spelling in ({"expert_parallel_size": 3}, {"parallel": {"expert_parallel_size": 3}}):
        with pytest.raises(ValueError, match="does not divide"):  # before any rank starts
            LLM("qwen3-moe-tiny", device="cpu", **spelling)


# ---- end to end: EP2 against EP1 and transformers ---------------------------------------


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _watch_group_steps(llm: LLM) -> tuple[list, list]:
    """Record rank 0's phase at every step it had work, and (rank 0's header, the group's
    step) at every step of the group."""
    runner, phases, steps = llm.engine.runner, [], []
    group_step, exchange = runner.group_step, runner.lockstep.exchange

    def phase_of(steps_, replay):
        q, c = [len(s.new_token_ids) for s in steps_], [s.num_computed for s in steps_]
        phases.append(ForwardBatch.phase_of(q, c))
        return group_step(steps_, replay)

    def recorded(header, sizes):
        steps.append((header, exchange(header, sizes)))
        return steps[-1][1]

    runner.group_step, runner.lockstep.exchange = phase_of, recorded
    return phases, steps


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    path = checkpoints.write_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-ep"))
    prompts = _prompts(512, [5, 60, 9, 17], seed=3, shared_prefix=12)
    return path, prompts, _hf_greedy(path, prompts)


def test_qwen3_moe_ep2_equals_ep1_and_transformers(qwen_moe):
    path, prompts, want = qwen_moe
    # A small token budget chunks the prompts: prefill, mixed and decode-only steps.
    kwargs = {"max_model_len": 128, "max_num_batched_tokens": 24, "device": "cpu"}
    ep2 = LLM(str(path), expert_parallel_size=2, **kwargs)
    try:
        phases, steps = _watch_group_steps(ep2)
        got = _generate(ep2, prompts)
        tokens = ep2.engine.expert_tokens()
        experts = ep2.engine.runner.model.model.layers[0].mlp.experts
    finally:
        ep2.engine.close()
    assert got == want
    assert got == _generate(LLM(str(path), **kwargs), prompts)
    assert {Phase.PREFILL, Phase.MIXED, Phase.DECODE} <= set(phases)
    # Rank 0 decoding while rank 1 still prefills: the group runs PREFILL mode (rank 0
    # alone would have chosen DECODE); rank 0 idle while rank 1 decodes: DECODE mode.
    assert any(h.decode_only and h.num_tokens and s.mode == PREFILL for h, s in steps)
    assert any(h.num_tokens == 0 and s.num_tokens[1] and s.mode == DECODE for h, s in steps)
    assert Counter(s.mode for _, s in steps) == ep2.engine.runner.lockstep.mode_counts
    assert len(tokens) == 2 and all(sum(t) > 0 for t in tokens)  # both ranks' experts worked
    assert experts.w13_weight.shape[0] == 4 and experts.shard.first == 0  # rank 0: 0..3


def test_requests_on_another_rank_can_be_aborted(qwen_moe):
    path, prompts, _ = qwen_moe
    ep2 = LLM(str(path), max_model_len=128, expert_parallel_size=2, device="cpu")
    engine = ep2.engine
    try:
        with pytest.raises(InvalidRequestError, match="already in use"):
            for _ in range(2):
                engine.add_request("on-rank-1", prompts[0], GREEDY)
        engine.add_request("on-rank-0", prompts[1], GREEDY)
        engine.step()
        assert engine.abort_request("on-rank-1")
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "on-rank-1" not in finished
        assert len(finished["on-rank-0"].outputs[0].token_ids) == NEW_TOKENS
    finally:
        engine.close()


def _route_to_rank1(path) -> None:
    """Every MoE layer's correction bias sends every token to experts 4..7 (rank 1's)."""
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if name.endswith(checkpoints.BIAS):
                tensor.zero_()[len(tensor) // 2 :] = 100.0
        save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("routing", ["router", "all_to_rank1"])
def test_glm4_moe_ep2_equals_ep1_and_transformers(routing, tmp_path):
    path = checkpoints.write_glm4_moe(tmp_path)
    if routing == "all_to_rank1":
        _route_to_rank1(path)
        prompts = _prompts(512, [21], seed=5)  # one request: rank 1 has nothing to do
    else:
        prompts = _prompts(512, [7, 30, 12], seed=4)
    kwargs = {"max_model_len": 128, "device": "cpu"}
    ep2 = LLM(str(path), expert_parallel_size=2, **kwargs)
    try:
        _, steps = _watch_group_steps(ep2)
        got = _generate(ep2, prompts)
        tokens = ep2.engine.expert_tokens()
    finally:
        ep2.engine.close()
    assert got == _hf_greedy(path, prompts)
    assert got == _generate(LLM(str(path), **kwargs), prompts)
    if routing == "all_to_rank1":
        assert all(s.num_tokens[1] == 0 for _, s in steps)  # rank 1 ran dummy steps only
        assert sum(tokens[0]) == 0 and sum(tokens[1]) > 0  # yet its experts did all the work


# ---- the command line ------------------------------------------------------------------


def _generate_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "generate", "--model", "qwen3-moe-tiny"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def test_generate_and_serve_take_expert_parallel_size():
    flags = ["--prompt", "decode", "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    proc = _generate_cli(*flags, "--json", "--device", "cpu", "--expert-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    want = LLM("qwen3-moe-tiny", device="cpu").generate(
        "decode", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert json.loads(proc.stdout)["token_ids"] == want[0].outputs[0].token_ids
    bad = _generate_cli(*flags, "--device", "cpu", "--expert-parallel-size", "3")
    assert bad.returncode == 2 and "does not divide the model's 8 routed experts" in bad.stderr

    from splitserve.cluster.serve_command import load_config

    fields = dict.fromkeys(
        ["config", "model", "prefill", "decode", "mixed", "host", "port", "device", "address"]
    )
    args = argparse.Namespace(**fields, api_key=None, expert_parallel_size=2)
    assert load_config(args).engine.parallel.expert_parallel_size == 2


def test_metrics_show_each_ranks_tokens_per_expert():
    from splitserve.cluster.metrics import PoolCollector
    from splitserve.workers.engine.messages import WorkerStats

    stats = WorkerStats(role="mixed", engine_pid=1, expert_tokens=[[3, 0], [5, 7]]).as_dict()
    collector = PoolCollector({"w0": ("mixed", stats)})
    family = next(f for f in collector.collect() if f.name == "splitserve_expert_tokens")
    got = {(s.labels["rank"], s.labels["expert"]): s.value for s in family.samples}
    assert got == {("0", "0"): 3, ("0", "1"): 0, ("1", "2"): 5, ("1", "3"): 7}


def test_an_engine_process_hosts_a_group_unchanged():
    """A replica's engine process builds ``LLMEngine(config)``; with two ranks it starts
    the other itself, and what a front is served equals one rank's tokens."""
    from splitserve.workers.engine.engine_client import EngineClient
    from splitserve.workers.engine.engine_connection import EngineConnection
    from splitserve.workers.engine.messages import Delta, GenerateCall

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i, 7, 42, 9 + i] * (i + 1) for i in range(4)]
    config = {"model": "qwen3-moe-tiny", "device": "cpu", "scheduler": {"max_model_len": 256}}
    client = EngineClient(
        EngineConfig.from_dict({**config, "parallel": {"expert_parallel_size": 2}}), secret="s"
    )

    async def served() -> list[list[int]]:
        front = await EngineConnection.open(client.address, "s", "the test")

        async def tokens(call: GenerateCall) -> list[int]:
            got = []
            async for events in front.generate(call):
                got += [t for e in events if isinstance(e, Delta) for t in e.token_ids]
            return got

        calls = [GenerateCall(f"r{i}", p, params) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*map(tokens, calls)))
        finally:
            front.close()

    try:
        got = asyncio.run(served())
    finally:
        client.shutdown()
    llm = LLM("qwen3-moe-tiny", device="cpu", max_model_len=256)
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- a rank's shard of the experts -----------------------------------------------------


def test_a_rank_loads_and_reads_only_its_experts(qwen_moe, monkeypatch):
    import safetensors

    from splitserve.workers.model import loader
    from splitserve.workers.model.layers.moe import ExpertShard

    path = qwen_moe[0]
    config = load_hf_config(str(path))[0]
    whole = loader.load_model(config, path, torch.float32, "cpu")
    read: list[str] = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    shard = ExpertShard(first=4, count=4, total=8)
    half = loader.load_model(config, path, torch.float32, "cpu", expert_shard=shard)
    mine, full = half.model.layers[0].mlp.experts, whole.model.layers[0].mlp.experts
    assert torch.equal(mine.w13_weight, full.w13_weight[4:])
    assert torch.equal(mine.w2_weight, full.w2_weight[4:])
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {4, 5, 6, 7}


def test_random_init_gives_a_shard_the_whole_models_experts():
    from splitserve.workers.model.layers.moe import ExpertShard
    from splitserve.workers.model.loader import load_model

    config = load_hf_config("qwen3-moe-tiny")[0]
    whole = load_model(config, None, torch.float32, "cpu", seed=5)
    half = load_model(config, None, torch.float32, "cpu", seed=5, expert_shard=ExpertShard(4, 4, 8))
    assert torch.equal(
        half.model.layers[1].mlp.experts.w2_weight, whole.model.layers[1].mlp.experts.w2_weight[4:]
    )


def test_prefill_and_decode_workers_keep_their_modes(qwen_moe):
    """An EP2 prefill worker hands KV to an EP2 decode worker over the CPU transport:
    every group step of the prefill worker runs PREFILL mode, every one of the decode
    worker DECODE mode (its ranks idle or not), and the tokens are transformers'."""
    from splitserve.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig
    from splitserve.workers.engine.llm_engine import LLMEngine
    from tests.test_disaggregation import Handoff

    path, prompts, want = qwen_moe

    def engine(role: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(path), device="cpu", role=role,
                cache=CacheConfig(num_kv_blocks=128),
                scheduler=SchedulerConfig(max_model_len=128),
                kv_transfer=KVTransferConfig(transport="cpu", timeout_s=30.0),
                parallel=ParallelConfig(expert_parallel_size=2),
            )
        )  # fmt: skip

    prefill, decode = engine("prefill"), engine("decode")
    try:
        run = Handoff(prefill, decode)
        for i, p in enumerate(prompts):
            run.submit(f"r{i}", p, GREEDY)
        run.run(timeout=120.0)
        prefill_modes = prefill.runner.lockstep.mode_counts
        decode_modes = decode.runner.lockstep.mode_counts
    finally:
        prefill.close()
        decode.close()
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == want
    assert len({t.address for t in run.tickets.values()}) == 2  # both decode ranks received
    assert set(prefill_modes) <= {PREFILL, None} and prefill_modes[PREFILL]
    assert set(decode_modes) <= {DECODE, None} and decode_modes[DECODE]
