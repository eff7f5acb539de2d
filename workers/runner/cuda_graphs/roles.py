"""Which CUDA graphs a worker captures, by its role.

A graph costs capture time at start-up and GPU memory (its pool) for as long as
the worker lives, so a worker captures only the graphs its steps can replay:

| role    | its steps                                   | captures                   |
|---------|---------------------------------------------|----------------------------|
| prefill | prompts (chunked); a request ends after its | piecewise                  |
|         | first token, so no step ever decodes        |                            |
| decode  | decodes and MTP verifies and drafts; the    | decode, MTP draft          |
|         | short prompts it computes itself run eager  |                            |
| mixed   | both, in shared batches                     | piecewise, decode, draft   |

The names are the graph runners' (``GraphRunner.name``).
"""

from __future__ import annotations

PIECEWISE, DECODE, DRAFT = "piecewise", "decode", "mtp_draft"
GRAPHS_BY_ROLE: dict[str, frozenset[str]] = {
    "prefill": frozenset({PIECEWISE}),
    "decode": frozenset({DECODE, DRAFT}),
    "mixed": frozenset({PIECEWISE, DECODE, DRAFT}),
}


def graphs_for(role: str) -> frozenset[str]:
    """The graph runners a worker of ``role`` captures."""
    if role not in GRAPHS_BY_ROLE:
        raise ValueError(f"unknown worker role {role!r}; roles: {', '.join(GRAPHS_BY_ROLE)}")
    return GRAPHS_BY_ROLE[role]
