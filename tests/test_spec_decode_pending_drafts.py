"""The drafter's drafts are read back lazily (CPU, torch attention): ``step()`` returns with
them still on the device, the next step reads them just before it schedules, and the
tokens are those of reading them back at once (and of decoding without MTP)."""

from __future__ import annotations

import pytest

from splitserve.scheduler.request import RequestStatus
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


def record_steps(eng, events: list[str]) -> None:
    """Log each schedule and each return of ``step``; at the return, check that the
    step's drafts are still pending: held, not read back, on no request yet."""
    schedule, step = eng.scheduler.schedule, eng.step

    def scheduled():
        events.append("schedule")
        return schedule()

    def stepped():
        outputs = step()
        events.append("returned")
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
    """The flow before lazy drafts: each step's drafts onto the requests as it returns."""
    step = eng.step

    def stepped():
        outputs = step()
        eng._resolve_drafts()
        return outputs

    eng.step = stepped


def test_drafts_are_read_back_just_before_the_next_schedule(context_glm, reads):
    """Batched prompts of different lengths, chunked prefill, an abort between steps, K = 1..3:
    each step returns with its drafts pending and the next one reads them before it
    schedules; tokens and verified drafts equal reading them back at once."""
    batch = prompts()
    expected = generate(engine(context_glm, max_num_batched_tokens=16), batch, abort="r2")
    for k in (1, 2, 3):
        eager = engine(context_glm, k, max_num_batched_tokens=16)
        read_back_at_once(eager)
        assert generate(eager, batch, abort="r2") == expected, f"K={k}"
        reads.clear()
        lazy = engine(context_glm, k, max_num_batched_tokens=16)
        record_steps(lazy, reads)
        assert generate(lazy, batch, abort="r2") == expected, f"K={k}"
        steps = " ".join(reads).split("returned")[:-1]
        assert sum("read" in s for s in steps) > len(steps) // 2  # a read most steps
        assert all(s.split() in (["read", "schedule"], ["schedule"]) for s in steps), reads
        assert (lazy.spec_stats.num_draft_tokens, lazy.spec_stats.acceptance_lengths) == (
            eager.spec_stats.num_draft_tokens,
            eager.spec_stats.acceptance_lengths,
        )
        assert 0 < lazy.spec_stats.num_accepted_tokens < lazy.spec_stats.num_draft_tokens
        assert lazy._pending_drafts is None  # idle: nothing held on the device
        assert_all_blocks_free(lazy)


def test_an_abort_while_the_drafts_are_pending_drops_them(context_glm, reads):
    """The one request aborted between its step and the read-back: the engine is idle,
    holds no drafts and never reads them; the id then serves a new request unchanged."""
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
