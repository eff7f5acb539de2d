"""The OpenAI-compatible HTTP ingress: validate, tokenize, route, stream.

One request's path through the pools (``cluster.routing`` picks the route):

- local: one streaming ``generate`` call on a mixed or decode worker.
- disaggregated: a streaming ``generate(remote=True)`` on a decode worker,
  which reserves blocks and yields a KV ticket (or decides to compute a
  prefix-cache hit itself); then ``prefill(ticket)`` on a prefill worker,
  which streams the KV to the decode worker and returns once it is acked.
  If the prefill fails, the decode call is cancelled (its blocks are freed).

A worker failure before the first token is retried once on a fresh pair; after
it, the request ends with an error. A client that goes away cancels both
calls, so both workers free the request's KV blocks.
"""

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError

from splitserve.cluster import routing
from splitserve.cluster.metrics import INGRESS, ServingMetrics
from splitserve.cluster.openai_api import (
    OpenAIError,
    chat_prompt,
    completion_prompt,
    context_length_exceeded,
    error_body,
    invalid_request,
    model_not_found,
    overloaded,
    parse_request,
    response_builder,
    sse_stream,
)
from splitserve.cluster.serve_config import ServeConfig
from splitserve.cluster.stats_board import get_or_create_board
from splitserve.cluster.worker_calls import WorkerFailed, guard, watch_prefill
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.messages import Delta, GenerateCall, Routed, TicketIssued
from splitserve.workers.model.loader import load_hf_config
from splitserve.workers.model.tokenizer import load_tokenizer, tiny_tokenizer
from splitserve.workers.output.request_output import RequestOutput

logger = logging.getLogger(__name__)
app = FastAPI(title="splitserve")

MAX_ATTEMPTS = 2


@serve.deployment(name="ingress")  # replicas and limits: ``ingress_deployment`` in app.py
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict, prefill=None, decode=None, mixed=None):
        self.config = ServeConfig.from_dict(config)
        hf_config, path = load_hf_config(self.config.engine.model)
        self.tokenizer = load_tokenizer(path) if path is not None else tiny_tokenizer()
        limit = hf_config.max_position_embeddings
        self.max_model_len = self.config.engine.scheduler.max_model_len or limit
        self.vocab_size = hf_config.vocab_size
        self.pools = {"prefill": prefill, "decode": decode, "mixed": mixed}
        self.metrics = ServingMetrics()
        context = serve.get_replica_context()
        self.replica_id = f"{INGRESS}-{context.replica_id.unique_id}"
        self.board = get_or_create_board(context.app_name)
        self.created = int(time.time())
        self._poster = asyncio.get_event_loop().create_task(self._post_metrics())

    # ---- endpoints ----------------------------------------------------------

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
        snapshot = await self.board.snapshot.remote()
        live = {pool: 0 for pool, handle in self.pools.items() if handle is not None}
        for pool, _ in snapshot.values():
            if pool != INGRESS:
                live[pool] = live.get(pool, 0) + 1
        can_serve = live.get("mixed", 0) > 0 or (
            live.get("prefill", 0) > 0 and live.get("decode", 0) > 0
        )
        body = {"status": "ok" if can_serve else "unavailable", "replicas": live}
        return JSONResponse(body, status_code=200 if can_serve else 503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        snapshot = await self.board.snapshot.remote()
        body = self.metrics.render(snapshot, self.replica_id)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _post_metrics(self) -> None:
        """This replica's request metrics to the board, for ``/metrics`` on any replica."""
        while True:
            try:
                samples = {"samples": self.metrics.samples()}
                self.board.post.remote(self.replica_id, INGRESS, samples)
            except Exception:  # the board restarts with the app; keep serving meanwhile
                logger.warning("could not post request metrics", exc_info=True)
            await asyncio.sleep(self.config.stats_period_s)

    def get_config(self) -> dict:
        """The running config (``splitserve scale`` edits and redeploys it)."""
        return self.config.to_dict()

    # ---- one request --------------------------------------------------------

    async def _serve(self, kind: str, request: Request) -> Response:
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
        outputs = self._generate(request_id, prompt_ids, params)
        if req.stream:
            return StreamingResponse(sse_stream(builder, outputs), media_type="text/event-stream")
        try:
            async for output in outputs:
                builder.add(output)
        except OpenAIError as e:
            return JSONResponse(error_body(e), status_code=e.status)
        return JSONResponse(builder.response())

    async def _validate(self, kind: str, request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid_request(f"the request body is not valid JSON: {e}") from e
        req = parse_request(kind, body)
        if req.model is not None and req.model not in (
            self.config.model_name,
            self.config.engine.model,
        ):
            raise model_not_found(req.model, [self.config.model_name])
        if kind == "completions":
            text, ids = completion_prompt(req, self.tokenizer, self.vocab_size)
        else:
            text, ids = chat_prompt(req, self.tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise context_length_exceeded(len(ids), self.max_model_len)
        params = req.to_sampling_params(self.max_model_len - len(ids))
        return req, text, ids, params

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request, with retry, metrics and cancellation."""
        pools = {name: handle is not None for name, handle in self.pools.items()}
        route = routing.choose_route(
            self.config.router, len(prompt_ids), pools["prefill"], pools["decode"], pools["mixed"]
        )
        start = last = time.monotonic()
        num_tokens, outcome = 0, "cancelled"
        routes = [route]
        try:
            for attempt in range(MAX_ATTEMPTS):
                rid = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
                try:
                    async for output in self._attempt(routes, rid, prompt_ids, params):
                        now = time.monotonic()
                        n = len(output.new_token_ids)
                        if n and num_tokens == 0:
                            self.metrics.ttft.labels(routes[-1]).observe(now - start)
                        elif n:
                            self.metrics.itl.labels(routes[-1]).observe((now - last) / n)
                        num_tokens, last = num_tokens + n, now
                        yield output
                    outcome = "ok"
                    self.metrics.e2e.labels(routes[-1]).observe(time.monotonic() - start)
                    return
                except WorkerFailed as e:
                    if num_tokens or attempt + 1 == MAX_ATTEMPTS:
                        outcome = "error"
                        raise OpenAIError(500, str(e), "server_error") from e
                    logger.warning("request %s: %s; retrying", request_id, e)
                except BackPressureError as e:
                    outcome = "error"
                    raise overloaded(f"the {routes[-1]} route is overloaded: {e}") from e
                except OpenAIError:
                    outcome = "error"
                    raise
        finally:
            self.metrics.requests.labels(routes[-1], outcome).inc()

    def _attempt(self, routes: list[str], rid, prompt_ids, params) -> AsyncIterator:
        """One try along the first route; the decode worker may append the route it took."""
        call = GenerateCall(rid, prompt_ids, params)
        if routes[0] == routing.DISAGGREGATED:
            return self._disaggregated(call, routes)
        return self._local("mixed" if routes[0] == routing.LOCAL_MIXED else "decode", call)

    async def _local(self, pool: str, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        stream = self.pools[pool].options(stream=True).generate.remote(call)
        try:
            async for event in guard(stream, f"{pool} worker"):
                if isinstance(event, Delta):
                    yield event.to_output()
        finally:
            stream.cancel()

    async def _disaggregated(self, call: GenerateCall, routes: list[str]) -> AsyncIterator:
        ratio = self.config.router.local_prefix_hit_ratio
        remote = dataclasses.replace(call, remote=True, local_prefix_ratio=ratio)
        decode = self.pools["decode"].options(stream=True).generate.remote(remote)
        prefill_call, watcher, failure = None, None, []
        try:
            async for event in guard(decode, "decode worker", failure):
                if isinstance(event, Routed):
                    routes.append(event.route)
                elif isinstance(event, TicketIssued):
                    prefill = dataclasses.replace(call, kv_ticket=event.ticket)
                    prefill_call = self.pools["prefill"].prefill.remote(prefill)
                    watcher = asyncio.ensure_future(watch_prefill(prefill_call, decode, failure))
                elif isinstance(event, Delta):
                    yield event.to_output()
        finally:
            decode.cancel()
            if prefill_call is not None:
                prefill_call.cancel()
                watcher.cancel()
