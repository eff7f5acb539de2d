"""The OpenAI-compatible HTTP ingress: validate, tokenize, route, stream.

The ingress talks to the workers' engine processes directly, one connection
each (``cluster/worker_directory.py`` keeps them and ranks them by load), so a
token travels engine -> ingress -> client with no Ray call in between and one
frame per engine step. One request's path (``cluster.routing`` picks the route):

- local: one ``GenerateCall`` to a mixed or decode worker's engine.
- disaggregated: a ``GenerateCall(remote=True)`` to a decode worker, which
  reserves blocks and answers with a KV ticket (or decides to compute a
  prefix-cache hit itself, and the prefill call is aborted); at the same time
  (``router.prefill_before_ticket``; else once the ticket is in) the call to a
  prefill worker, which computes the prompt, gets the ticket in a ``LateTicket``,
  streams the KV to the decode worker and ends once it is acked. The prefill
  worker's first token is streamed as soon as it is sampled (the decode worker's copy
  of it, once the KV is in, is left out). If the prefill fails, the decode side's
  stream ends with the cause (its blocks are freed).

A worker failure before the first token is retried once on a fresh pair,
without the worker that failed; after it, the request ends with an error (a decode
worker lost mid hand-off, once the prefill worker's first token went out, too). A
retry that fails too, or finds no worker left, ends with the first attempt's cause. A
client that goes away aborts the request on both workers, so both free its KV
blocks. Every worker of a pool at its limit: the request waits (up to the pool's
``max_queued_requests``), then 503.

Draining (``serve`` shutting down sets a deadline on the stats board; or this
replica leaving): new requests get 503 with ``Retry-After``, those in flight run
on until the deadline (``drain_timeout_s``), then end with "shutting down".
"""

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from splitserve.cluster import routing
from splitserve.cluster.engine_profiles import profile_engines
from splitserve.cluster.http_guard import HttpGuard
from splitserve.cluster.metrics import INGRESS, ServingMetrics
from splitserve.cluster.openai_api import (
    OpenAIError,
    as_openai_error,
    error_body,
    for_client,
    overloaded,
    response_builder,
    sse_stream,
)
from splitserve.cluster.openai_api.intake import RequestIntake
from splitserve.cluster.openai_api.openapi import describe
from splitserve.cluster.serve_config import ServeConfig
from splitserve.cluster.sse_response import EventStreamResponse
from splitserve.cluster.stats_board import get_or_create_board
from splitserve.cluster.worker_calls import (
    WorkerBusy,
    WorkerFailed,
    culprit,
    guard,
    watch_prefill,
)
from splitserve.cluster.worker_directory import NoWorker, PoolOverloaded, WorkerDirectory
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.messages import Delta, GenerateCall, Routed, TicketIssued
from splitserve.workers.model.loader import load_hf_config
from splitserve.workers.model.tokenizer import load_tokenizer, tiny_tokenizer
from splitserve.workers.output.request_output import RequestOutput

logger = logging.getLogger(__name__)
app = FastAPI(title="splitserve")
describe(app)  # /openapi.json names the request bodies and errors

MAX_ATTEMPTS = 2  # a worker failure before the first token is retried once
MAX_BUSY_RETRIES = 16  # workers answering Overloaded (their load reports lagged)
DRAIN_RETRY_AFTER_S = 5  # Retry-After of the 503s while draining
SHUTTING_DOWN = "the server is shutting down"


def _with_cause(message: str, first_failure: str | None) -> str:
    """A retried request's error, with what made the first attempt fail (the real cause,
    where the retry only met its consequence: the failed worker gone, or none left)."""
    if first_failure is None:
        return message
    return f"{message} (on a retry; the first attempt failed: {first_failure})"


@serve.deployment(name="ingress")  # replicas and limits: ``ingress_deployment`` in app.py
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict, secret: str, prefill=None, decode=None, mixed=None):
        """``prefill``/``decode``/``mixed``: the pools' deployments (None: not deployed);
        ``secret``: what the workers' engines ask of a connection."""
        self.config = ServeConfig.from_dict(config)
        hf_config, path = load_hf_config(self.config.engine.model)
        self.tokenizer = load_tokenizer(path) if path is not None else tiny_tokenizer()
        limit = hf_config.max_position_embeddings
        self.max_model_len = self.config.engine.scheduler.max_model_len or limit
        self.vocab_size = hf_config.vocab_size
        names = (self.config.model_name, self.config.engine.model)
        self.intake = RequestIntake(
            self.tokenizer, self.vocab_size, self.max_model_len, names, self.config.engine.limits
        )
        self.pools = {"prefill": prefill, "decode": decode, "mixed": mixed}
        ep = self.config.engine.parallel.expert_parallel_size
        self._prefill_before_ticket = self.config.router.prefill_before_ticket and ep == 1
        self.metrics = ServingMetrics()
        context = serve.get_replica_context()
        self.replica_id = f"{INGRESS}-{context.replica_id.unique_id}"
        self.board = get_or_create_board(context.app_name)
        self.created = int(time.time())
        pools = {name: self.config.pools[name] for name, h in self.pools.items() if h is not None}
        self.workers = WorkerDirectory(self.board, secret, pools, self.config.router)
        self._in_flight = 0  # requests this replica is generating
        self._drain_deadline: float | None = None  # time.time() by which they must end
        self._closing = False  # past it: open streams end with SHUTTING_DOWN
        loop = asyncio.get_event_loop()
        self._poster = loop.create_task(self._post_metrics())
        self._watcher = loop.create_task(self.workers.run(self.config.stats_period_s))

    def __serve_build_asgi_app__(self):
        """Ray Serve calls this once the replica is built: the app behind the HTTP guards,
        which hand the completions endpoints their requests directly."""
        routes = {
            ("POST", "/v1/completions"): functools.partial(self._serve_asgi, "completions"),
            ("POST", "/v1/chat/completions"): functools.partial(self._serve_asgi, "chat"),
        }
        return HttpGuard(self._asgi_app, self.config.http, routes)

    # ---- endpoints ----------------------------------------------------------
    # The two completions endpoints are served through ``_serve_asgi`` (the guard's
    # routes); the app declares them for its OpenAPI document.

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve("chat", request)

    @app.get("/v1/models")
    async def models(self) -> dict:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "root": self.config.engine.model,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(self) -> Response:
        # The engines this replica can route to now (connected, not stalled, not draining):
        # ready means a request sent now finds a worker, not that a replica exists.
        live = {
            pool: len(self.workers.ranked(pool))
            for pool, handle in self.pools.items()
            if handle is not None
        }
        can_serve = live.get("mixed", 0) > 0 or (
            live.get("prefill", 0) > 0 and live.get("decode", 0) > 0
        )
        status = "ok" if can_serve else "unavailable"
        if self._drain_deadline is not None:
            status, can_serve = "draining", False
        body = {"status": status, "replicas": live}
        return JSONResponse(body, status_code=200 if can_serve else 503)

    @app.post("/start_profile")
    async def start_profile(self) -> Response:
        """Every engine records with torch.profiler (``engine_profiles.py``)."""
        return await self._profile(start=True)

    @app.post("/stop_profile")
    async def stop_profile(self) -> Response:
        """Every engine writes what it recorded since ``/start_profile``."""
        return await self._profile(start=False)

    async def _profile(self, start: bool) -> Response:
        live = {pool: self.workers.connections(pool) for pool, h in self.pools.items() if h}
        return await profile_engines(live, self.config.engine.torch_profiler_dir, start)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        snapshot = await self.board.snapshot.remote()
        body = self.metrics.render(snapshot, self.replica_id)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _post_metrics(self) -> None:
        """This replica's request metrics to the board, for ``/metrics`` on any replica,
        and the app's drain deadline from it."""
        while True:
            try:
                samples = {"samples": self.metrics.samples(), "in_flight": self._in_flight}
                self.board.post.remote(self.replica_id, INGRESS, samples)
                deadline = await self.board.drain_deadline.remote()
                if deadline is not None:
                    self._drain(deadline)
            except Exception:  # the board restarts with the app; keep serving meanwhile
                logger.warning("could not post request metrics", exc_info=True)
            await asyncio.sleep(self.config.stats_period_s)

    def _drain(self, deadline: float) -> None:
        """Admit nothing new; past ``deadline`` end the open streams."""
        if self._drain_deadline is None:
            logger.info("draining: %d requests in flight", self._in_flight)
        self._drain_deadline = min(deadline, self._drain_deadline or deadline)
        if time.time() >= self._drain_deadline and not self._closing:
            self._closing = True
            logger.warning("drain time is over: ending %d requests", self._in_flight)
            self.workers.fail_open(SHUTTING_DOWN)

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown of this replica (it already waited for its HTTP
        requests): what is still open gets until the drain timeout, then ends."""
        self._drain(time.time() + self.config.drain_timeout_s)
        while self._in_flight and not self._closing:
            await asyncio.sleep(0.1)
            self._drain(self._drain_deadline)
        ended = time.monotonic() + 2.0  # the ended streams send their errors
        while self._in_flight and time.monotonic() < ended:
            await asyncio.sleep(0.1)

    def get_config(self) -> dict:
        """The running config (``splitserve scale`` edits and redeploys it)."""
        return self.config.to_dict()

    # ---- one request --------------------------------------------------------

    async def _serve_asgi(self, kind: str, scope, receive, send) -> None:
        response = await self._serve(kind, Request(scope, receive))
        await response(scope, receive, send)

    async def _serve(self, kind: str, request: Request) -> Response:
        received = time.monotonic()  # the TTFT counts intake too
        if self._drain_deadline is not None:
            err = overloaded(f"{SHUTTING_DOWN}; retry on another server or later")
            self.metrics.rejected.labels(str(err.status)).inc()
            headers = {"Retry-After": str(DRAIN_RETRY_AFTER_S)}
            return JSONResponse(error_body(err), status_code=err.status, headers=headers)
        try:
            req, prompt_text, prompt_ids, params = await self._validate(kind, request)
        except OpenAIError as e:
            self.metrics.rejected.labels(str(e.status)).inc()
            return JSONResponse(error_body(e), status_code=e.status)
        prefix = "cmpl" if kind == "completions" else "chatcmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        builder = response_builder(
            req,
            self.tokenizer,
            prompt_ids,
            self.config.model_name,
            prompt_text=prompt_text,
            request_id=request_id,
        )
        outputs = self._generate(request_id, prompt_ids, params, received)
        if req.stream:
            return EventStreamResponse(sse_stream(builder, outputs))
        try:
            async for output in outputs:
                builder.add(output)
        except Exception as e:
            err = for_client(as_openai_error(e), request_id)
            return JSONResponse(error_body(err), status_code=err.status)
        return JSONResponse(builder.response())

    async def _validate(self, kind: str, request: Request):
        # The body is read (and its size checked) by the HTTP guard.
        intake = await self.intake.parse_async(kind, await request.body())
        return intake.request, intake.prompt_text, intake.prompt_token_ids, intake.params

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, start: float
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request, with retry, metrics and cancellation; ``start``:
        when the request came in (``time.monotonic()``)."""
        pools = {name: handle is not None for name, handle in self.pools.items()}
        backlog = {p: self.workers.least_queued_prompt_tokens(p) for p in ("prefill", "decode")}
        route = routing.choose_route(
            self.config.router,
            len(prompt_ids),
            pools["prefill"],
            pools["decode"],
            pools["mixed"],
            prefill_backlog=backlog["prefill"],
            decode_backlog=backlog["decode"],
        )
        last = time.monotonic()
        num_tokens, outcome = 0, "cancelled"
        routes, failed, first_failure = [route], set(), None
        self._in_flight += 1
        try:
            for attempt in range(MAX_ATTEMPTS):
                rid = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
                try:
                    async for output in self._attempt(routes, rid, prompt_ids, params, failed):
                        now = time.monotonic()
                        n = len(output.new_token_ids)
                        if n and num_tokens == 0:
                            self._first_token(routes[-1], now - start, output)
                            itl = self.metrics.itl.labels(routes[-1])  # the route is known
                        elif n:
                            itl.observe((now - last) / n)
                        num_tokens, last = num_tokens + n, now
                        yield output
                    outcome = "ok"
                    self.metrics.e2e.labels(routes[-1]).observe(time.monotonic() - start)
                    return
                except WorkerFailed as e:
                    if self._closing:
                        outcome = "error"
                        raise OpenAIError(503, SHUTTING_DOWN, "server_error") from e
                    if num_tokens or attempt + 1 == MAX_ATTEMPTS:
                        outcome = "error"
                        message = _with_cause(str(e), first_failure)
                        raise OpenAIError(500, message, "server_error") from e
                    first_failure = str(e)
                    logger.warning("request %s: %s; retrying", request_id, e)
                except (PoolOverloaded, NoWorker) as e:
                    outcome = "error"
                    state = "is overloaded" if isinstance(e, PoolOverloaded) else "has no worker"
                    message = f"the {routes[-1]} route {state}: {e}"
                    raise overloaded(_with_cause(message, first_failure)) from e
                except OpenAIError:
                    outcome = "error"
                    raise
        finally:
            self._in_flight -= 1
            self.metrics.requests.labels(routes[-1], outcome).inc()

    def _first_token(self, route: str, ttft: float, output: RequestOutput) -> None:
        """The TTFT, and where it went when the engine that sampled the token said."""
        self.metrics.ttft.labels(route).observe(ttft)
        times = output.first_token_times
        if times is not None:
            self.metrics.queue_time.labels(route).observe(times.queued_s)
            self.metrics.prefill_time.labels(route).observe(times.prefill_s)
            path = max(0.0, ttft - times.queued_s - times.prefill_s)
            self.metrics.ttft_path.labels(route).observe(path)

    async def _attempt(self, routes, rid, prompt_ids, params, failed: set[str]) -> AsyncIterator:
        """One try along the first route; the decode worker may append the route it took.
        ``failed``: the workers that failed this request, to leave out (names added here)."""
        call = GenerateCall(rid, prompt_ids, params)
        for _ in range(MAX_BUSY_RETRIES):
            busy: set[str] = set()
            try:
                if routes[0] == routing.DISAGGREGATED:
                    stream = self._disaggregated(call, routes, failed, busy)
                else:
                    pool = "mixed" if routes[0] == routing.LOCAL_MIXED else "decode"
                    stream = self._local(pool, call, failed, busy)
                async for output in stream:
                    yield output
                return
            except WorkerBusy as e:  # nothing was computed: pick again
                logger.info("request %s: %s", rid, e)
        raise PoolOverloaded(f"{MAX_BUSY_RETRIES} workers in turn answered busy")

    async def _local(self, pool: str, call: GenerateCall, failed, busy) -> AsyncIterator:
        worker = await self.workers.acquire(pool, exclude=failed | busy)
        stream = worker.generate(call)
        try:
            async for event in guard(stream, worker.name):
                if isinstance(event, Delta):
                    yield event.to_output()
        except WorkerBusy:
            busy.add(worker.name)
            raise
        except WorkerFailed:
            failed.add(worker.name)
            raise
        finally:
            await stream.aclose()  # not finished: aborts it on the engine

    def _reserves_at_once(self, decode, call: GenerateCall) -> bool:
        stats = decode.stats
        return stats is not None and routing.reserves_at_once(
            stats.num_free_blocks,
            len(call.prompt_token_ids),
            decode.sent_tokens_since_stats,
            self.config.engine.cache.block_size,
        )

    async def _disaggregated(self, call: GenerateCall, routes: list[str], failed, busy):
        """The decode worker reserves blocks and answers with a ticket; the prefill worker
        computes the prompt and sends its KV there. With ``prefill_before_ticket``, when
        the decode worker has the blocks free and a prefill worker has room, the prompt
        goes to the prefill worker at once and the ticket follows it (its first token is
        held until the decode worker's route is known)."""
        decode = await self.workers.acquire("decode", exclude=failed | busy)
        ratio = self.config.router.local_prefix_hit_ratio
        stream = decode.generate(dataclasses.replace(call, remote=True, local_prefix_ratio=ratio))
        prefill, prefill_task, routed = None, None, asyncio.Event()
        if self._prefill_before_ticket and self._reserves_at_once(decode, call):
            # Only a prefill worker free now: else the decode worker's reservation (what an
            # autoscaled prefill pool at zero replicas grows on) goes first, as without it.
            prefill = self.workers.available("prefill", exclude=failed)
        if prefill is not None:
            prefill_call = dataclasses.replace(call, ticket_follows=True)
            prefill_task = asyncio.ensure_future(
                watch_prefill(prefill, prefill_call, decode, call.request_id, routed)
            )
        try:
            async for event in guard(stream, decode.name):
                if isinstance(event, Routed):
                    routes.append(event.route)
                    if event.route == routing.DISAGGREGATED:
                        routed.set()
                    elif prefill_task is not None:  # computed where it decodes
                        prefill_task.cancel()  # aborts it on the prefill worker
                        prefill, prefill_task = None, None
                elif isinstance(event, TicketIssued) and prefill_task is not None:
                    prefill.send_ticket(call.request_id, event.ticket)
                elif isinstance(event, TicketIssued):
                    prefill = await self.workers.acquire("prefill", exclude=failed)
                    prefill_call = dataclasses.replace(call, kv_ticket=event.ticket)
                    prefill_task = asyncio.ensure_future(
                        watch_prefill(prefill, prefill_call, decode, call.request_id)
                    )
                elif isinstance(event, Delta):
                    yield event.to_output()
        except WorkerBusy:
            busy.add(decode.name)
            raise
        except WorkerFailed:
            failed.add(culprit(decode, prefill, prefill_task).name)
            raise
        finally:
            await stream.aclose()  # not finished: aborts it on the engine
            if prefill_task is not None:
                prefill_task.cancel()
