"""What speculative decoding achieved on this worker: drafts verified, drafts accepted, and
how long the accepted runs were (``splitserve_spec_decode_*`` on /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.scheduler.request import Request


@dataclass
class SpecDecodeStats:
    num_draft_tokens: int = 0  # drafts verified, in total
    num_accepted_tokens: int = 0  # of those, accepted
    # acceptance_lengths[n]: verify steps of one request that accepted n drafts
    acceptance_lengths: list[int] = field(default_factory=list)

    def count(self, sampling: list[Request], sampled: dict[str, tuple[list[int], list]]) -> None:
        """One step's verified drafts; call before the scheduler settles them."""
        for request in sampling:
            num_drafts = len(request.spec_token_ids)
            if request.is_finished or not num_drafts:
                continue
            accepted = len(sampled[request.request_id][0]) - 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += accepted
            if len(self.acceptance_lengths) <= accepted:
                self.acceptance_lengths += [0] * (accepted + 1 - len(self.acceptance_lengths))
            self.acceptance_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
