"""The extender's HTTP surface: ``filter``, ``prioritize`` and ``bind`` as kube-scheduler calls them,
the DeviceShare debug API, Prometheus metrics and a health check.

Verbs are served under both ``/<verb>`` and ``/scheduler/<verb>`` (the fixture's
``urlPrefix``). A malformed body is a 400 with a message, an oversized one a
413, one that does not arrive in time a 408; a failure inside a verb becomes
the reply's ``Error`` field, never a 500 or a hang. Every verb's cost is
bounded before the expensive work (:mod:`kubegpu.scheduler.limits`).
Filter and prioritize only read the view; bind is the one commit point: it
works from the API server's pod (never what an earlier ``/filter`` body
said about that UID: the watch's copy of the pending pod, bound only at that
version, else a GET; see :mod:`kubegpu.scheduler.pending`), chooses the GPUs and holds them before its
next ``await``, so concurrent binds can never be handed the same capacity, posts one Binding that carries
the ``kubegpu.io/device-allocated`` annotation (the API server applies both
in one write), and releases the hold if that fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
import msgspec
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kubegpu.httpserve import BodyError, receive_body
from kubegpu.kube.slim import SlimPod
from kubegpu.kube.writes import abind_pod, is_conflict, is_not_found, retry_async
from kubegpu.model import annotations as A
from kubegpu.model.allocation import AnnotationError, PodAllocation, decode, encode
from kubegpu.model.signing import record_annotations
from kubegpu.placement import DEFAULT_POLICY, PlacementConflict
from kubegpu.scheduler import wire
from kubegpu.scheduler.limits import Limits, LoopShare, bounded_filter, too_many_gpu_containers
from kubegpu.scheduler.metrics import ExtenderMetrics
from kubegpu.scheduler.parsed import parsed_pod as parse_pod  # once per pod version
from kubegpu.scheduler.pending import PendingPods
from kubegpu.scheduler.requests import pod_policies
from kubegpu.scheduler.state import ClusterView

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # 5,000 full Node objects fit; anything larger is refused

VerbHandler = Callable[[Scope, Receive], Awaitable[Response]]


def _starlette_verb(handler: VerbHandler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(request.scope, request.receive)
    return endpoint


HANDOFF_WAIT_S_ENV = "KUBEGPU_HANDOFF_WAIT_S"
DEFAULT_HANDOFF_WAIT_S = 7.0
HANDOFF_POLL_S = 0.01
# Reads of the pod one bind may make: the watch's copy, the API server's pod, and once more when the pod
# changed between that read and the Binding (its resourceVersion is the Binding's precondition).
BIND_READS = 3


def _handoff_wait_from_env() -> float:
    raw = os.environ.get(HANDOFF_WAIT_S_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_HANDOFF_WAIT_S
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60:
        log.error("%s=%r is not a number of seconds in [0, 60]; using %g", HANDOFF_WAIT_S_ENV, raw,
                  DEFAULT_HANDOFF_WAIT_S)
        return DEFAULT_HANDOFF_WAIT_S
    return value


# Nodes of the debug API's all-nodes answer built between two turns of the event loop (~5 ms of CPU).
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
                 ready: Callable[[], bool] = lambda: True, limits: Limits | None = None,
                 body_timeout_s: float = 10.0, handoff_wait_s: float | None = None,
                 pending: PendingPods | None = None, per_gpu_metrics: bool = False) -> None:
        self.view = view
        self.pending = pending  # the watch of unbound pods bind reads first (None: a GET at every bind)
        # How long a bind waits for its node to finish handing a pod of the same kind to the kubelet before it
        # fails (kube-scheduler then retries after its back-off): below kube-scheduler's extender httpTimeout
        # (the manifests render 10 s), so the answer always arrives before kube-scheduler gives up on it.
        self.handoff_wait_s = handoff_wait_s if handoff_wait_s is not None else _handoff_wait_from_env()
        self.client = client
        self.node_policy = node_policy
        self.gpu_policy = gpu_policy
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.limits = limits or Limits()
        self.metrics = ExtenderMetrics(view, per_gpu=per_gpu_metrics)
        self._ready = ready
        self._bind_locks: dict[str, asyncio.Lock] = {}
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

    def policies(self, pod: dict[str, Any]) -> tuple[str, str]:
        return pod_policies(pod, self.node_policy, self.gpu_policy)

    # ---- verbs ---------------------------------------------------------------------------------
    async def filter(self, body: bytes) -> Response:
        args = wire.decode_args(body, self.names)
        assert args.Pod is not None
        names = wire.node_names(args)
        try:
            self.view.expire_assumed()
            _, gpu_policy = self.policies(args.Pod)
            out = await bounded_filter(self.view, args.Pod, names, gpu_policy, self.limits, share=self.share)
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
            node_policy, _ = self.policies(args.Pod)
            if not too_many_gpu_containers(args.Pod, self.limits.max_gpu_containers):
                return _json(self.view.prioritize_json(args.Pod, names, node_policy, self.names.encoded(names)))
        except Exception:
            log.exception("prioritize failed")  # errors are ignored by the scheduler: score nothing
        # refused by filter (nothing to score), or failed
        return _json(wire.encode_priorities(names, [0] * len(names), self.names.encoded(names)))

    async def bind(self, body: bytes) -> Response:
        args = wire.decode_binding(body)
        key = f"{args.PodNamespace}/{args.PodName}"
        lock = self._bind_locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                error = await self._bind(args, key)
        finally:
            if not lock.locked() and not lock._waiters:  # type: ignore[attr-defined]
                self._bind_locks.pop(key, None)
        if error:
            log.warning("bind %s to %s failed: %s", key, args.Node, error)
        return _json(wire.encode(wire.ExtenderBindingResult(error)))

    async def _bind(self, args: wire.ExtenderBindingArgs, key: str) -> str:
        if self.client is None:
            return "kubegpu bind: no API client configured"
        ns, name, node = args.PodNamespace, args.PodName, args.Node
        held = self.view.held.get(key)
        if held is not None and not held.binding and (not args.PodUID or held.uid == args.PodUID):
            if held.node == node:
                return ""  # a retry of a bind that went through (ours, or one the watch has shown)
            self.metrics.bind_failures.labels("already-bound").inc()
            return f"kubegpu bind: pod {key} is already bound to {held.node}"
        deadline = asyncio.get_running_loop().time() + self.handoff_wait_s  # one wait per bind, whatever it reads
        # Always the API server's pod: what an earlier /filter body said about this UID is not evidence. First
        # the watch's copy of the pending pod, which binds only at the version copied (the Binding's
        # precondition) and never refuses on its own word (scheduler/pending.py); then a GET.
        pod = self.pending.get(key, args.PodUID) if self.pending is not None else None
        if pod is not None:
            outcome = await self._bind_pod(args, key, pod, deadline, confirmed=False)
            if isinstance(outcome, str):
                return outcome
            pod = outcome.pod
        for _ in range(BIND_READS - 1):
            if pod is None:
                try:
                    current = await retry_async(lambda: self.client.get(SlimPod, name, namespace=ns))  # type: ignore[union-attr]
                except ApiError as e:
                    self.metrics.bind_failures.labels("pod-lookup").inc()
                    return f"kubegpu bind: cannot read pod {key}: {e.status.message}"
                except (OSError, httpx2.HTTPError) as e:
                    self.metrics.bind_failures.labels("api-unreachable").inc()
                    return f"kubegpu bind: API server unreachable: {e}"
                pod = current.to_dict()
            outcome = await self._bind_pod(args, key, pod, deadline, confirmed=True)
            if isinstance(outcome, str):
                return outcome
            pod = outcome.pod
        self.metrics.bind_failures.labels("api-error").inc()
        return f"kubegpu bind: pod {key} kept changing while it was being bound; retried after back-off"

    async def _bind_pod(self, args: wire.ExtenderBindingArgs, key: str, pod: dict[str, Any], deadline: float, *,
                        confirmed: bool) -> str | _Reread:
        """Bind ``pod`` (the API server's, as a GET or the watch showed it) to ``args.Node``: '' or the reason
        it failed, or :class:`_Reread` to start over from the API server's pod. Unconfirmed (the watch's
        copy), every refusal that depends on the pod is a reread, so that only the API server's current pod
        is ever refused; so is a Binding the API server refuses as a conflict (the pod changed since the copy,
        was recreated, or was bound since) or as not found (deleted since)."""
        ns, name, node = args.PodNamespace, args.PodName, args.Node
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        version = str(meta.get("resourceVersion") or "")
        if args.PodUID and uid != args.PodUID:
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("uid-changed").inc()
            return f"kubegpu bind: pod {key} is now UID {uid}, not {args.PodUID} (recreated)"
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if not confirmed:
                return _Reread()
            recorded = _recorded(pod)
            if bound_to == node and recorded is not None:  # bound by an earlier attempt of ours
                self._hold_quietly(key, uid, node, recorded)
                return ""
            self.metrics.bind_failures.labels("already-bound").inc()
            return f"kubegpu bind: pod {key} is already bound to {bound_to}"
        if why := too_many_gpu_containers(pod, self.limits.max_gpu_containers):
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("refused").inc()
            return f"kubegpu bind: {why}"
        if why := await self._handoff_turn(pod, node, deadline):
            if not confirmed:  # the API server's pod waits for what is left of the same deadline (none)
                return _Reread()
            self.metrics.bind_failures.labels("handoff-wait").inc()
            return f"kubegpu bind: {why}"
        # Choose and hold before the first await below: no other bind can take the same capacity, and no
        # other pod of this kind can start waiting on the node between the check above and this hold.
        current = self.view.held.get(key)  # read again: the watch may have moved while this bind waited
        if current is not None:
            if current.uid == uid:  # the watch has shown this pod bound since: the API server's pod answers
                return _Reread()
            self.view.release(key)  # an earlier pod of this name, deleted (its event still to come)
        _, gpu_policy = self.policies(pod)
        alloc, why = self.view.choose(pod, node, gpu_policy)
        if alloc is None:
            if not confirmed:
                return _Reread()
            self.metrics.bind_failures.labels("no-fit").inc()
            return f"kubegpu bind: {why}"
        try:
            self.view.hold(key, uid, node, alloc, assumed=True, pod=pod)
        except PlacementConflict as e:  # cannot happen right after choose; refuse rather than over-commit
            self.metrics.bind_failures.labels("no-fit").inc()
            return f"kubegpu bind: {e}"
        value = encode(alloc)
        record = record_annotations(value, uid, node, self.view.record_key)  # signed for the node (h11)
        try:
            # One write: the API server copies the Binding's annotations onto the pod as it sets
            # spec.nodeName, so a pod is never on a node without its record; the UID and the version the GPUs
            # were chosen for are its preconditions.
            try:
                await retry_async(lambda: abind_pod(self.client, ns, name, uid, node,  # type: ignore[arg-type]
                                                    record, resource_version=version))
            except ApiError as e:
                if not is_conflict(e):
                    if not confirmed and is_not_found(e):  # gone since the copy: answered as after a GET
                        self.view.release_assumed(key, uid, node)
                        return _Reread()
                    raise
                ours, fresh = await self._bound_to(ns, name, node, value)
                if not ours:
                    # Refused for the pod as the API server has it now (as after a GET) when that is the pod just
                    # bound with. Otherwise bind again from what it has: after the watch's copy, always (a GET if
                    # the pod is gone); after the API server's own pod, when that pod changed while unbound.
                    now = _version(fresh) if fresh is not None else None
                    if now != (uid, version, "") and (not confirmed or (now is not None and now[0] == uid
                                                                        and not now[2])):
                        self.view.release_assumed(key, uid, node)
                        return _Reread(fresh)
                    raise
        except ApiError as e:
            self.view.release_assumed(key, uid, node)
            self.metrics.bind_failures.labels("api-error").inc()
            return f"kubegpu bind: API error {e.status.code}: {e.status.message}"
        except Exception as e:
            self.view.release_assumed(key, uid, node)
            self.metrics.bind_failures.labels("api-unreachable").inc()
            return f"kubegpu bind: {type(e).__name__}: {e}"
        self.view.mark_bound(key)
        self.metrics.placed.inc()
        return ""

    async def _handoff_turn(self, pod: dict[str, Any], node: str, deadline: float | None = None) -> str:
        """Wait until no other pod of this pod's kind (kubelet resource, device count) waits on ``node`` for
        its handoff: the one-waiting-record rule, enforced here where binds are serialized (kube-scheduler
        binds asynchronously: the next pod is filtered before the previous bind arrives). '' once it is this
        pod's turn; the reason when it is not within ``handoff_wait_s`` (or by ``deadline``, on the loop's
        clock, when given). The caller holds right after, with
        no await in between, so two binds of a kind can never both pass. Identical pods (a Deployment scaling
        up) flow at the node's admission pace with no back-off; the wait is a dict lookup per tick."""
        request = parse_pod(pod)
        if not request.wants_gpu:
            return ""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.handoff_wait_s
        while not self._ready():
            # Who waits is rebuilt from the pods (records, acknowledgements, phases): before the first LIST is
            # in (a restart), a pod waiting on the node is invisible and the rule would be guessed.
            if loop.time() >= deadline:
                return "the extender is still listing the cluster's pods (after a start); retried after back-off"
            await asyncio.sleep(HANDOFF_POLL_S)
        ledger = self.view.ledger
        if ledger.handoff_blocked(pod, request).get(node) is None:
            return ""
        ledger.waiting_binds[node] = ledger.waiting_binds.get(node, 0) + 1
        try:
            while (why := ledger.handoff_blocked(pod, request).get(node)) is not None:
                if loop.time() >= deadline:
                    return f"{why}; not its turn within {self.handoff_wait_s:g} s, retried after back-off"
                await asyncio.sleep(HANDOFF_POLL_S)
            return ""
        finally:
            left = ledger.waiting_binds.get(node, 1) - 1
            if left > 0:
                ledger.waiting_binds[node] = left
            else:
                ledger.waiting_binds.pop(node, None)

    async def _bound_to(self, ns: str, name: str, node: str, value: str) -> tuple[bool, dict[str, Any] | None]:
        """After a 409 on the Binding: is the pod bound to ``node`` with our record (a retry that raced)? And
        the pod as the API server has it now (None when it is gone)."""
        try:
            current = await self.client.get(SlimPod, name, namespace=ns)  # type: ignore[union-attr]
        except ApiError as e:
            if getattr(e.status, "code", None) == 404:
                return False, None
            raise
        pod = current.to_dict()
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        return (spec.get("nodeName") == node and (meta.get("annotations") or {}).get(A.DEVICE_ALLOCATED) == value,
                pod)

    def _hold_quietly(self, key: str, uid: str, node: str, alloc: PodAllocation) -> None:
        try:
            self.view.hold(key, uid, node, alloc)
        except PlacementConflict as e:
            log.error("pod %s: recorded GPUs collide with another pod's: %s", key, e)

    # ---- debug API, metrics, health ------------------------------------------------------------
    async def summaries(self, request: Request) -> Response:
        """Every node's summary, streamed a few nodes at a time with the loop's other work between: at 5,000
        nodes the answer is ~32 MB and ~1 s of CPU, which held every filter, prioritize and bind (and the
        extender's memory) when it was built at once (measured: bind's slowest call 1.09 s during one)."""
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

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        if self._ready():
            return Response("ok", media_type="text/plain")
        return Response("informers not synced (or view not warmed up) yet", status_code=503, media_type="text/plain")


class _Reread:
    """Bind starts over from the API server's pod: ``pod`` when the conflict's GET just read it, else a GET."""

    __slots__ = ("pod",)

    def __init__(self, pod: dict[str, Any] | None = None) -> None:
        self.pod = pod


def _version(pod: dict[str, Any]) -> tuple[str, str, str]:
    """(UID, resourceVersion, node bound to or '') of a pod."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""), str(spec.get("nodeName") or "")


def _recorded(pod: dict[str, Any]) -> PodAllocation | None:
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(A.DEVICE_ALLOCATED)
    if not value:
        return None
    try:
        return decode(value)
    except AnnotationError:
        return None
