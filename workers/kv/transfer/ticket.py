"""What the two sides of a KV hand-off tell each other, packed with msgpack.

A decode worker reserves blocks for a prompt and issues a ``TransferTicket``;
the prefill worker computes the prompt, sends each layer's KV for tokens
``start_token .. num_tokens - 1`` into the ticket's blocks, then a
``TransferDone`` with the first sampled token; the decode worker answers with
a ``TransferAck``. The KV travels token-major (``[2, tokens, heads, head_dim]``
per layer), so the two sides may use different block sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack
import torch

from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.output.request_output import FirstTokenTimes


@dataclass(frozen=True)
class TransferTicket:
    request_id: str
    address: str  # the receiver's transport address
    block_ids: list[int]  # the receiver's blocks for tokens 0 .. num_tokens - 1
    start_token: int  # tokens before it are in the receiver's prefix cache already
    num_tokens: int  # the prompt length
    num_layers: int  # layers 0 .. num_layers - 1 are sent
    layout: KVLayout  # the receiver's cache: block size, heads, head size, dtype
    owner: str = ""  # the receiving worker's id, for out-of-band calls (NCCL rendezvous)

    def pack(self) -> bytes:
        return msgpack.packb({**asdict(self), "layout": self.layout.to_wire()})

    @classmethod
    def unpack(cls, data: bytes) -> TransferTicket:
        fields = msgpack.unpackb(data)
        fields["layout"] = KVLayout.from_wire(fields["layout"])
        return cls(**fields)

    @property
    def block_size(self) -> int:
        """The receiver's block size."""
        return self.layout.block_size

    @property
    def num_transfer_tokens(self) -> int:
        return self.num_tokens - self.start_token


@dataclass(frozen=True)
class TransferDone:
    """Sent after the last layer: the first token, which the decode side emits."""

    request_id: str
    first_token: int
    logprob: float | None = None  # logprobs of the first token, when asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # MTP drafts after the first token
    kv_scales: list[float] = field(default_factory=list)  # FP8 caches: the sender's K, V scales
    # the prefill engine's share of the TTFT, for the decode side's first output
    first_token_times: FirstTokenTimes | None = None


@dataclass(frozen=True)
class TransferAck:
    request_id: str
    ok: bool
    error: str | None = None


def token_slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of tokens ``start .. end - 1`` under a block table."""
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def transfer_bytes(layout: KVLayout, ticket: TransferTicket) -> int:
    """Bytes of K and V that the ticket's transfer moves, as ``layout`` holds them."""
    return layout.bytes_per_token(ticket.num_layers) * ticket.num_transfer_tokens
