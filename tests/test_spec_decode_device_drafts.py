"""The drafter's drafts stay on the device (CPU, torch attention): ``step()`` returns with
them pending, the next schedule sizes each request's step by their number alone (the ids
read as ``PLACEHOLDER``), the next step's inputs take them from the device, and nothing
reads them back; the tokens are those of reading them back at once, and of decoding
without MTP."""

from __future__ import annotations

import pytest

from splitserve.scheduler.request import PLACEHOLDER, RequestStatus
from splitserve.workers.spec_decode.speculator import PendingDrafts
from tests.mtp_checkpoints import write_glm4_moe_drafter
from tests.test_spec_decode import GREEDY, assert_all_blocks_free, engine, generate, prompts


@pytest.fixture(scope="module")
def context_glm(tmp_path_factory):
    """The drafter is right now and then: accepted and rejected drafts."""
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-context"), context_scale=0.15)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """``"read"`` each time a ``PendingDrafts`` is read back (not its memoized repeats)."""
    events: list[str] = []
    result = PendingDrafts.result

    def read(self: PendingDrafts) -> dict[str, list[int]]:
        if not self.read_back:
            events.append("read")
        return result(self)

    monkeypatch.setattr(PendingDrafts, "result", read)
    return events


def record_steps(eng, scheduled_drafts: list[list[int]]) -> None:
    """At each return of ``step``: the step's drafts pending, on no request yet. At each
    schedule: the drafts of every running request (``scheduled_drafts``)."""
    schedule, step = eng.scheduler.schedule, eng.step

    def scheduled():
        running = [r for r in eng.scheduler.running if r.status == RequestStatus.RUNNING]
        scheduled_drafts.extend(list(r.spec_token_ids) for r in running)
        return schedule()

    def stepped():
        outputs = step()
        running = [r for r in eng.scheduler.running if r.status == RequestStatus.RUNNING]
        assert all(r.spec_token_ids == [] for r in running)
        pending = eng._pending_drafts
        if pending is not None:
            assert not pending.read_back
            k = eng.runner.num_speculative_tokens
            assert pending.tokens.shape == (len(pending.requests), k)
        return outputs

    eng.scheduler.schedule, eng.step = scheduled, stepped


def read_back_at_once(eng) -> None:
    """The flow before device drafts: each step's drafts read back onto the requests as
    it returns, their real ids in the next step's host inputs (as a decode worker's first
    drafts come, from its prefill worker)."""
    step = eng.step

    def stepped():
        outputs = step()
        pending, eng._pending_drafts = eng._pending_drafts, None
        if pending is not None:
            drafts = pending.result()
            for request in pending.requests:
                if request.status == RequestStatus.RUNNING:
                    request.spec_token_ids = drafts[request.request_id]
        return outputs

    eng.step = stepped


@pytest.mark.parametrize("budget", [16, 6], ids=["chunked", "drafts-trimmed-or-dropped"])
def test_drafts_stay_on_the_device(context_glm, reads, budget):
    """Batched prompts of different lengths, chunked prefill, an abort between steps, K = 1..3;
    at a budget of 6 tokens a step a verify step cannot hold every request's drafts (some
    are trimmed, some requests wait a step and lose theirs): no draft is ever read back,
    every schedule sees placeholders only, and tokens and verified drafts equal reading
    them back at once."""
    batch = prompts()
    expected = generate(engine(context_glm, max_num_batched_tokens=budget), batch, abort="r2")
    for k in (1, 2, 3):
        eager = engine(context_glm, k, max_num_batched_tokens=budget)
        read_back_at_once(eager)
        assert generate(eager, batch, abort="r2") == expected, f"K={k}"
        reads.clear()
        lazy = engine(context_glm, k, max_num_batched_tokens=budget)
        drafts: list[list[int]] = []
        record_steps(lazy, drafts)
        assert generate(lazy, batch, abort="r2") == expected, f"K={k}"
        assert reads == []
        assert any(drafts) and all(set(d) <= {PLACEHOLDER} for d in drafts)
        assert (lazy.spec_stats.num_draft_tokens, lazy.spec_stats.acceptance_lengths) == (
            eager.spec_stats.num_draft_tokens,
            eager.spec_stats.acceptance_lengths,
        )
        assert 0 < lazy.spec_stats.num_accepted_tokens < lazy.spec_stats.num_draft_tokens
        assert lazy._pending_drafts is None and lazy._device_drafts is None  # idle
        assert_all_blocks_free(lazy)


def test_an_abort_while_the_drafts_are_pending_drops_them(context_glm, reads):
    """The one request aborted between its step and the next: the engine is idle, holds no
    drafts and never reads them; the id then serves a new request unchanged."""
    prompt = prompts()[1]
    eng = engine(context_glm, k=2)
    eng.add_request("r0", prompt, GREEDY)
    eng.step()  # the prompt: its first token, its drafts pending
    assert eng._pending_drafts is not None and not eng._pending_drafts.read_back
    assert eng.abort_request("r0")
    assert eng._pending_drafts is None and not eng.has_unfinished_requests()
    assert_all_blocks_free(eng)
    assert reads == []
    assert generate(eng, [prompt]) == generate(engine(context_glm), [prompt])


@pytest.mark.parametrize("k", [2, 3])
def test_a_request_left_out_of_a_step_loses_its_drafts_on_the_device(context_glm, reads, k):
    """Three two-token prompts prefill in one step and are all drafted for; the next step's
    budget holds two verify steps, so the third request waits: its drafts (in the memory
    of the step that left it out) are dropped, it decodes without drafts next, and the
    tokens equal decoding without MTP."""
    batch = [[11, 12], [13, 14], [15, 16]]
    budget = 2 * (k + 1)
    eng = engine(context_glm, k, max_num_batched_tokens=budget)
    requests = {f"r{i}": eng.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)}
    eng.step()  # every prompt, its first token and drafts
    eng.step()  # r0 and r1 verify; r2 waits
    assert requests["r2"].spec_token_ids == [] and requests["r2"].num_output_tokens == 1
    assert eng._device_drafts is None
    while eng.has_unfinished_requests():
        eng.step()
    tokens = {rid: r.output_token_ids for rid, r in requests.items()}
    assert tokens == generate(engine(context_glm, max_num_batched_tokens=budget), batch)
    assert reads == []
    assert_all_blocks_free(eng)


def test_the_first_pass_is_queued_before_the_host_waits_for_the_runs(context_glm, monkeypatch):
    """A decode worker's step: the drafter's first pass (over every row, fed the emitted
    tokens on the device) is launched before the host reads the accepted runs back; the
    chained passes, which start where the runs end, after."""
    from splitserve.workers.spec_decode.rejection_sampler import PendingRuns

    order: list[str] = []
    result = PendingRuns.result
    monkeypatch.setattr(PendingRuns, "result", lambda self: (order.append("runs"), result(self))[1])
    eng = engine(context_glm, k=2)
    proposer = eng.runner.speculator.proposer
    for name in ("first_pass", "chain"):
        call = getattr(proposer, name)
        monkeypatch.setattr(
            proposer, name, lambda *a, _n=name, _c=call, **k: (order.append(_n), _c(*a, **k))[1]
        )
    tokens = generate(eng, prompts()[:2])
    verify_steps = [i for i, name in enumerate(order) if name == "runs"]
    assert verify_steps and all(
        order[i - 1 : i + 2] == ["first_pass", "runs", "chain"] for i in verify_steps
    )
    assert tokens == generate(engine(context_glm), prompts()[:2])


def test_drafts_read_back_are_not_held_for_the_next_step(context_glm):
    """Drafts read back (a prefill worker sends them with the KV) have left the device:
    the engine does not hold them for a next step to read there, even while a request
    they were drafted for runs."""
    eng = engine(context_glm, k=2)
    request = eng.add_request("r0", prompts()[1], GREEDY)
    eng.step()
    pending = eng._pending_drafts
    assert pending is not None and request.status == RequestStatus.RUNNING
    eng._hold_drafts(pending)
    assert eng._pending_drafts is pending  # on the device: held
    pending.result()
    eng._hold_drafts(pending)
    assert eng._pending_drafts is None
    eng.abort_request("r0")
    assert_all_blocks_free(eng)
