"""The CPU time of a process tree by role: which part of a served system used the CPU.

``snapshot(root)`` reads ``/proc`` for ``root`` and every descendant: each one's CPU
ticks (user and system, with the children it has reaped) and its role. ``by_role``
turns two snapshots into CPU seconds by role, over the time between them. Roles,
from the process titles Ray and the engine set:

- ``client``: ``root`` itself (the load generator);
- ``<deployment> replica``: a Ray Serve replica (``ray::ServeReplica:<app>:<deployment>``,
  e.g. ``ingress replica``, ``decode replica``);
- ``<deployment> engine``: a process a replica started, and its own children: the
  engine process (``core_process``), expert-parallel ranks, compile workers;
- ``HAProxy``: the HTTP front Ray Serve runs;
- ``Ray and others``: the rest (Ray's controller, GCS, raylet, dashboard, ...).

Without ``/proc`` a snapshot is empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REPLICA = "ray::ServeReplica:"
CLIENT, HAPROXY, OTHERS = "client", "HAProxy", "Ray and others"


@dataclass(frozen=True)
class Proc:
    ticks: int  # user + system, with reaped children
    role: str


def snapshot(root: int) -> dict[int, Proc]:
    """``root`` and its descendants now: pid -> ticks and role."""
    stats = _read_all()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, Proc] = {}
    todo = [(root, None)]
    while todo:
        pid, parent_role = todo.pop()
        if pid not in stats:
            continue
        _, ticks, title = stats[pid]
        role = CLIENT if pid == root else role_of(title, parent_role)
        out[pid] = Proc(ticks, role)
        todo += [(child, role) for child in children.get(pid, [])]
    return out


def role_of(title: str, parent_role: str | None) -> str:
    """A process's role from its title and its parent's role."""
    if title.startswith(REPLICA):
        name = (title[len(REPLICA) :].split() or ["?"])[0]  # app:deployment
        return f"{name.rsplit(':', 1)[-1]} replica"
    if parent_role is not None and parent_role.endswith((" replica", " engine")):
        return parent_role.rsplit(" ", 1)[0] + " engine"
    if os.path.basename(title.split(" ", 1)[0]) == "haproxy":
        return HAPROXY
    return OTHERS


def by_role(before: dict[int, Proc], after: dict[int, Proc]) -> dict[str, float]:
    """CPU seconds by role between two snapshots (a process new since ``before`` counts
    from 0; one that ended and was reaped inside the tree counts in its parent)."""
    hz = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for pid, proc in after.items():
        old = before.get(pid)
        used = proc.ticks - (old.ticks if old is not None and old.role == proc.role else 0)
        seconds[proc.role] = seconds.get(proc.role, 0.0) + max(used, 0) / hz
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def _read_all() -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, ticks, title)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                title = f.read(512).replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # it ended
        fields = stat.rsplit(")", 1)[1].split()
        title = title or stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]), title)
    return out
