"""The extender's HTTP surface: ``filter``, ``prioritize`` and ``bind`` as kube-scheduler calls them,
the DeviceShare debug API, Prometheus metrics and a health check. HTTP only: each verb's body is decoded,
its pod planned once (:mod:`kubegpu.scheduler.plan`) and handed to the view (filter, prioritize) or the
binder (:mod:`kubegpu.scheduler.bind`).

Verbs are served under both ``/<verb>`` and ``/scheduler/<verb>`` (the fixture's
``urlPrefix``). A malformed body is a 400 with a message, an oversized one a
413, one that does not arrive in time a 408; a failure inside a verb becomes
the reply's ``Error`` field, never a 500 or a hang. Every verb's cost is
bounded before the expensive work (:mod:`kubegpu.scheduler.limits`).
Filter and prioritize only read the view; bind is the one commit point. A filter also counts the pods in flight
(passed by filter, or bound and not yet held) and may wait for their binds (:mod:`kubegpu.scheduler.inflight`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from lightkube import AsyncClient
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kubegpu.httpserve import BodyError, receive_body
from kubegpu.placement import DEFAULT_POLICY
from kubegpu.placement.reservations import ReservationConfig
from kubegpu.scheduler import wire
from kubegpu.scheduler.bind import DEFAULT_HANDOFF_WAIT_S, Binder
from kubegpu.scheduler.inflight import DEFAULT_FILTER_WAIT_S, InFlight
from kubegpu.scheduler.limits import Limits, LoopShare, bounded_filter
from kubegpu.scheduler.metrics import ExtenderMetrics
from kubegpu.scheduler.pending import PendingPods
from kubegpu.scheduler.plan import PlanCache, PlanSettings
from kubegpu.scheduler.reservations import Reservations
from kubegpu.scheduler.state import ClusterView

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # 5,000 full Node objects fit; anything larger is refused

VerbHandler = Callable[[Scope, Receive], Awaitable[Response]]


def _starlette_verb(handler: VerbHandler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(request.scope, request.receive)
    return endpoint


# Nodes of the debug API's all-nodes answer built between two turns of the event loop: a step short enough
# that the verbs waiting behind it are not held up.
SUMMARY_NODES_PER_STEP = 25


def _json(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type="application/json")


def _bad(message: str, status: int = 400) -> Response:
    headers = {"connection": "close"} if status in (408, 413) else None  # the rest of the body is not read
    return Response(wire.encode({"Error": message}), status_code=status, media_type="application/json",
                    headers=headers)


class Extender:
    """The extender: the view it reads, the API client it binds with, and its defaults."""

    def __init__(self, view: ClusterView, client: AsyncClient | None, *, node_policy: str = DEFAULT_POLICY,
                 gpu_policy: str = DEFAULT_POLICY, max_body_bytes: int = MAX_BODY_BYTES,
                 ready: asyncio.Event | None = None, limits: Limits | None = None,
                 body_timeout_s: float = 10.0, handoff_wait_s: float = DEFAULT_HANDOFF_WAIT_S,
                 pending: PendingPods | None = None, per_gpu_metrics: bool = False,
                 gpu_resources: frozenset[str] = frozenset(), reservations: ReservationConfig | None = None,
                 clock: Callable[[], float] = time.time, filter_wait_s: float = DEFAULT_FILTER_WAIT_S) -> None:
        self.view = view
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.limits = limits or Limits()
        # Every verb and watch event asks the same pod versions: each is planned once (the CycleState).
        self.plans = PlanCache(PlanSettings(node_policy, gpu_policy, self.limits.max_gpu_containers, gpu_resources))
        self.metrics = ExtenderMetrics(view, per_gpu=per_gpu_metrics)
        # GPUs kept for waiting wide pods: the verbs read them through the view (``clock``: the wall clock
        # pods' creation and start times are on).
        self.reservations = view.reservations = Reservations(
            view.nodes, view.mirror, view.ledger, reservations, clock,
            on_placed=lambda width, wait: self.metrics.wait.labels(width).observe(wait))
        # The pods passed by filter whose binds have not held their GPUs yet: a filter counts them (inflight.py).
        # Without an API client this extender never binds, so no filter waits for a bind.
        self.inflight = InFlight(view, wait_s=filter_wait_s if client is not None else 0.0)
        self.metrics.count_inflight(self.inflight)
        self.binder = Binder(view, client, self.plans, self.metrics, pending=pending, handoff_wait_s=handoff_wait_s,
                             ready=ready, inflight=self.inflight)
        self._ready = ready
        self.names = wire.NameMemo()  # kube-scheduler's node lists, recognised by their bytes
        self.share = LoopShare()  # requests in flight, for expensive filters to step aside
        # Each reason's counter, looked up once: a labels() lookup (lock, label checks) costs more than the
        # increment, and every filter counts a few reasons. Reason keys are the filter's own few words.
        self._rejected: dict[str, Any] = {}
        verbs = (("filter", self.filter), ("prioritize", self.prioritize), ("bind", self.bind))
        # kube-scheduler POSTs a verb three times per pod: those go straight to their handler (Starlette's
        # routing, middleware and request object cost more than the extender's answer); everything else
        # (the debug API, metrics, a verb path with another method: 405) goes through Starlette.
        self._verbs = {f"{prefix}/{name}": self._verb(name, fn) for prefix in ("", "/scheduler") for name, fn in verbs}
        routes = [Route(path, _starlette_verb(handler), methods=["POST"]) for path, handler in self._verbs.items()]
        self.routed = Starlette(routes=routes + self.debug_routes())
        # The same read-only routes alone, for a separate listener (metrics scraped from outside the pod
        # while the verbs stay on localhost beside kube-scheduler). The debug API names every GPU pod, so
        # the outside listener serves only /metrics and /healthz unless told otherwise (metrics_app).
        self.debug_app = Starlette(routes=self.debug_routes())
        self.metrics_app = Starlette(routes=[r for r in self.debug_routes() if r.path in ("/metrics", "/healthz")])

    def debug_routes(self) -> list[Route]:
        return [
            Route("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries", self.summaries, methods=["GET"]),
            Route("/apis/v1/plugins/DeviceShare/nodeDeviceSummaries/{node}", self.summary, methods=["GET"]),
            Route("/apis/v1/plugins/DeviceShare/workload", self.workload, methods=["GET"]),
            Route("/apis/v1/plugins/DeviceShare/reservations", self.reservations_summary, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]

    # ---- plumbing ------------------------------------------------------------------------------
    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The extender's ASGI app: the verbs directly, the rest through Starlette."""
        handler = self._verbs.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.routed(scope, receive, send)
            return
        response = await handler(scope, receive)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})

    def _verb(self, name: str, fn: Callable[[bytes], Awaitable[Response]]) -> VerbHandler:
        hist = self.metrics.latency.labels(name)

        async def handler(scope: Scope, receive: Receive) -> Response:
            start = time.perf_counter()
            try:
                with self.share.request():
                    body = await receive_body(scope, receive, self.max_body_bytes, self.body_timeout_s)
                    return await fn(body)
            except BodyError as e:
                self.metrics.bad_requests.labels(name).inc()
                if e.status == 499:
                    log.info("%s: %s", name, e)  # nobody is left to answer
                return _bad(str(e), e.status)
            except wire.WireError as e:
                self.metrics.bad_requests.labels(name).inc()
                return _bad(str(e))
            finally:
                hist.observe(time.perf_counter() - start)

        return handler

    # ---- verbs ---------------------------------------------------------------------------------
    async def filter(self, body: bytes) -> Response:
        args = wire.decode_args(body, self.names)
        assert args.Pod is not None
        names = wire.node_names(args)
        try:
            self.view.ledger.expire_assumed()
            plan = self.plans.plan(args.Pod)
            self.reservations.saw_filter(plan, args.Pod)  # it waits: a wide one may get a reservation
            out = await self.inflight.settle(
                plan, lambda: bounded_filter(self.view, plan, names, self.limits, share=self.share))
        except Exception as e:  # a bug must not fail scheduling silently: say it in Error
            log.exception("filter failed")
            return _json(wire.encode(wire.ExtenderFilterResult(None, None, {}, {}, f"kubegpu filter: {e}")))
        for reason, n in out.reasons.items():
            counter = self._rejected.get(reason)
            if counter is None:
                counter = self._rejected[reason] = self.metrics.rejected.labels(reason)
            counter.inc(n)
        if not out.passed and out.reasons:
            self.metrics.unschedulable.labels(out.reasons.most_common(1)[0][0]).inc()
        if args.NodeNames is not None:
            passed = msgspec.Raw(self.names.answered(out.passed, out.passed_json))  # prioritize is sent this list next
            result = wire.ExtenderFilterResult(None, passed, out.failed, out.unresolvable)
        else:
            assert args.Nodes is not None
            keep = set(out.passed)
            items = [item for item in args.Nodes.items if item["metadata"]["name"] in keep]
            result = wire.ExtenderFilterResult(wire.NodeList(items, args.Nodes.metadata), None, out.failed,
                                               out.unresolvable)
        return _json(wire.encode(result))

    async def prioritize(self, body: bytes) -> Response:
        args = wire.decode_args(body, self.names)
        assert args.Pod is not None
        names = wire.node_names(args)
        try:
            plan = self.plans.plan(args.Pod)
            if not plan.too_many:
                return _json(self.view.prioritize_json(plan, names, self.names.encoded(names)))
        except Exception:
            log.exception("prioritize failed")  # errors are ignored by the scheduler: score nothing
        # refused by filter (nothing to score), or failed
        return _json(wire.encode_priorities(names, [0] * len(names), self.names.encoded(names)))

    async def bind(self, body: bytes) -> Response:
        error = await self.binder.bind(wire.decode_binding(body))
        return _json(wire.encode(wire.ExtenderBindingResult(error)))

    # ---- debug API, metrics, health ------------------------------------------------------------
    async def summaries(self, request: Request) -> Response:
        """Every node's summary, streamed a few nodes at a time with the loop's other work between: at
        thousands of nodes the answer is tens of megabytes, and built at once it would hold every verb (and
        the extender's memory) until done."""
        names = sorted(self.view.nodes)

        async def body() -> AsyncIterator[bytes]:
            sep = b"{"
            for i in range(0, len(names), SUMMARY_NODES_PER_STEP):
                chunk = bytearray()
                for n in names[i:i + SUMMARY_NODES_PER_STEP]:
                    if (s := self.view.summary(n)) is not None:  # each node as it is now (gone: left out)
                        chunk += sep + wire.encode(n) + b":" + wire.encode(s)
                        sep = b","
                if chunk:
                    yield bytes(chunk)
                await asyncio.sleep(0)  # the verbs waiting go first
            yield b"{}" if sep == b"{" else b"}"

        return StreamingResponse(body(), media_type="application/json")

    async def summary(self, request: Request) -> Response:
        node = request.path_params["node"]
        s = self.view.summary(node)
        if s is None:
            return JSONResponse({"error": f"node {node} has no GPUs known to kubegpu"}, status_code=404)
        return _json(wire.encode(s))

    async def workload(self, request: Request) -> Response:
        """The target workload learned from the live pods (what fragmentation-aware scoring uses)."""
        return JSONResponse(self.view.scoring.learner.summary())

    async def reservations_summary(self, request: Request) -> Response:
        """The reservations for waiting wide pods (where each will run, what it waits for) and the waits by
        pod width."""
        return JSONResponse(self.reservations.summary())

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        if self._ready is None or self._ready.is_set():
            return Response("ok", media_type="text/plain")
        return Response("informers not synced (or view not warmed up) yet", status_code=503, media_type="text/plain")
