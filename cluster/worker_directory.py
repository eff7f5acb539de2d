"""The ingress's view of the worker pools: one connection to each engine, ranked by load.

Workers announce themselves on the stats board (their engine's ``address`` is in
their stats); the directory connects to each new one, drops the ones that left,
and ranks a pool's live engines with ``cluster.routing``'s costs from the load
each engine pushes over its connection (every stats period) plus the calls this
ingress sent since. ``acquire`` returns the best engine with room below the
pool's ``max_ongoing_requests``; when none has room, up to
``max_queued_requests`` callers wait for one (a stats push or a finished request
wakes them), and beyond that it raises ``PoolOverloaded`` (the ingress's 503).

Engines that cannot take a request are skipped at once: a draining one (its
replica is leaving; it finishes what it holds) and a stalled one (no load report,
or no step while holding requests, for the pool's ``stall_timeout_s``: a hung
process). A stalled engine's open streams end with ``Failed``, so requests without
a token yet are retried on another worker; it is chosen again once its reports
resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from splitserve.cluster.routing import RouterConfig, WorkerLoad, decode_cost, prefill_cost
from splitserve.cluster.serve_config import PoolConfig
from splitserve.workers.engine.engine_connection import EngineConnection

logger = logging.getLogger(__name__)

NO_WORKER_WAIT_S = 30.0  # how long a call waits for a pool's first worker to appear
STALL_CHECK_S = 0.25  # how often the engines are checked for stalls
LOOP_LAG_S = 0.5  # a check this late means the ingress lagged, not the engines


class PoolOverloaded(Exception):
    """Every worker of the pool is at its limit and the wait queue is full."""


class NoWorker(Exception):
    """The pool has no live worker."""


class WorkerDirectory:
    def __init__(self, board, secret: str, pools: dict[str, PoolConfig], router: RouterConfig):
        self._board = board
        self._secret = secret
        self._pools = pools  # the pools that exist (active) and their limits
        self._router = router
        self._workers: dict[str, tuple[str, EngineConnection]] = {}  # worker id -> (pool, conn)
        self._opening: set[str] = set()
        self._changed = {pool: asyncio.Event() for pool in pools}
        self._waiting = dict.fromkeys(pools, 0)
        self._stalled: set[str] = set()  # names of engines found stalled

    async def refresh(self) -> None:
        """Connect to workers new on the board; drop those disconnected. (Not those merely
        gone from the board: a replica that stops posting while its engine still serves
        is the watchdog's to judge; an engine whose replica is gone exits, and its
        connection ends.)"""
        snapshot = await self._board.snapshot.remote()
        for worker_id, (pool, stats) in snapshot.items():
            address = stats.get("address")
            known = worker_id in self._workers or worker_id in self._opening
            if pool in self._pools and address and not known:
                self._opening.add(worker_id)
                asyncio.ensure_future(self._connect(worker_id, pool, address))
        for worker_id, (pool, conn) in list(self._workers.items()):
            if not conn.alive:
                del self._workers[worker_id]
                self._stalled.discard(conn.name)
                conn.close()
                self._changed[pool].set()

    def least_queued_prompt_tokens(self, pool: str) -> int:
        """Prompt tokens queued on the pool's least-loaded live engine (0: none live)."""
        queued = [
            (c.stats.queued_prompt_tokens if c.stats else 0) + c.sent_tokens_since_stats
            for c in self.connections(pool)
        ]
        return min(queued, default=0)

    def connections(self, pool: str) -> list[EngineConnection]:
        return [c for p, c in self._workers.values() if p == pool and c.alive]

    async def acquire(self, pool: str, exclude: Iterable[str] = ()) -> EngineConnection:
        """The least-loaded live engine of ``pool`` with room, not in ``exclude`` (names)."""
        exclude = set(exclude)
        waited = False
        try:
            while True:
                conn = self.available(pool, exclude)
                if conn is not None:
                    return conn
                if not any(c.name not in exclude for c in self.ranked(pool)):
                    await self._wait_for_a_worker(pool, exclude)
                    continue
                if not waited:
                    if self._waiting[pool] >= self._pools[pool].max_queued_requests:
                        raise PoolOverloaded(
                            f"every {pool} worker holds its "
                            f"{self._pools[pool].max_ongoing_requests} requests and "
                            f"{self._waiting[pool]} more are waiting"
                        )
                    self._waiting[pool] += 1
                    waited = True
                await self._changed_in(pool)
        finally:
            if waited:
                self._waiting[pool] -= 1

    def available(self, pool: str, exclude: Iterable[str] = ()) -> EngineConnection | None:
        """What ``acquire`` would return now without waiting; None where it would wait (no
        live engine, or none with room)."""
        exclude = set(exclude)
        ranked = (c for c in self.ranked(pool) if c.name not in exclude)
        return next((c for c in ranked if self._has_room(pool, c)), None)

    def ranked(self, pool: str) -> list[EngineConnection]:
        """The pool's engines that may take a request, best first."""
        usable = [
            c for c in self.connections(pool) if c.name not in self._stalled and not c.draining
        ]
        return sorted(usable, key=lambda c: self._cost(pool, c))

    def check_stalls(self) -> None:
        """Mark the engines that look hung (and end their streams); unmark resumed ones."""
        for pool, conn in list(self._workers.values()):
            reason = conn.stalled(self._pools[pool].stall_timeout_s)
            if reason is None:
                if conn.name in self._stalled:
                    logger.warning("the %s resumed; routing to it again", conn.name)
                    self._stalled.discard(conn.name)
                    self._changed[pool].set()
                continue
            if conn.name not in self._stalled:
                logger.warning("the %s %s; routing around it", conn.name, reason)
                self._stalled.add(conn.name)
            if conn.num_open:
                conn.fail_open(f"the {conn.name} stalled ({reason})")

    def fail_open(self, message: str) -> None:
        """End every open stream on every engine with ``Failed`` (the ingress shuts down)."""
        for _, conn in self._workers.values():
            conn.fail_open(message)

    async def run(self, period_s: float) -> None:
        asyncio.ensure_future(self._watch_stalls())
        while True:
            try:
                await self.refresh()
            except Exception:  # the board restarts with the app; keep serving meanwhile
                logger.warning("could not read the stats board", exc_info=True)
            await asyncio.sleep(period_s)

    async def _watch_stalls(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            now = time.monotonic()
            # When this event loop itself lagged, the engines' reports may be waiting
            # in its sockets: judge them on the next round, once they were read.
            if now - last < STALL_CHECK_S + LOOP_LAG_S:
                self.check_stalls()
            last = now

    # ---- internals ---------------------------------------------------------------------

    async def _connect(self, worker_id: str, pool: str, address: str) -> None:
        name = f"{pool} worker {worker_id}"
        try:
            conn = await EngineConnection.open(address, self._secret, name)
        except (OSError, asyncio.TimeoutError) as e:
            logger.warning("could not connect to the %s at %s: %s", name, address, e)
            return
        finally:
            self._opening.discard(worker_id)
        conn.on_update = self._changed[pool].set
        self._workers[worker_id] = (pool, conn)
        self._changed[pool].set()

    async def _changed_in(self, pool: str) -> None:
        event = self._changed[pool]
        event.clear()
        await event.wait()

    async def _wait_for_a_worker(self, pool: str, exclude: set[str]) -> None:
        if exclude and self.ranked(pool):
            raise NoWorker(f"no other {pool} worker is live")
        await self.refresh()
        try:
            await asyncio.wait_for(self._changed_in(pool), NO_WORKER_WAIT_S)
        except asyncio.TimeoutError:
            raise NoWorker(f"no {pool} worker is live") from None

    def _has_room(self, pool: str, conn: EngineConnection) -> bool:
        load = WorkerLoad.from_stats(conn.stats)
        held = load.num_requests + conn.sent_since_stats
        return held < self._pools[pool].max_ongoing_requests

    def _cost(self, pool: str, conn: EngineConnection) -> tuple:
        load = WorkerLoad.from_stats(conn.stats)
        if pool == "prefill":
            return prefill_cost(load, conn.sent_tokens_since_stats)
        return decode_cost(self._router, load, conn.sent_since_stats)
