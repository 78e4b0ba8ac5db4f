"""The webhook's HTTP application: ``/mutate``, ``/validate``, ``/metrics``, ``/healthz``.

Both admission endpoints call :func:`kubegpu.model.normalise.review_pod`, the
function ``kubegpu check`` runs offline. ``/mutate`` answers with the JSON patch
that makes the pod canonical (and refuses what cannot be made so, early, with
the reason); ``/validate`` runs after every mutating webhook and has the last
word on the object that will be stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kubegpu.httpserve import BodyError, ServeLimits, receive_body
from kubegpu.install.security import EXTENDER_SA, NODE_SA
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS, count_gpu_containers, too_many_gpu_containers
from kubegpu.model.normalise import DEVICE_ENV_VARS, AdmissionPolicy, review_ephemeral, review_pod
from kubegpu.model.records import device_resource
from kubegpu.model.request import PodRequest, parse_pod
from kubegpu.model.signing import ACK_SIGNATURE, RECORD_SIGNATURE
from kubegpu.webhook.review import MAX_BODY_BYTES, BadReview, encode_json, read_review, write_response

log = logging.getLogger(__name__)
_JSON = "application/json"


RECORD_ANNOTATIONS = (A.DEVICE_ALLOCATED, A.DEVICE_ASSIGNED)
# kubegpu's own service accounts in its namespace, per record (install/security.py's names, as its policy):
# the extender writes device-allocated (through the Binding, which pod webhooks never see), the node daemon
# device-assigned.
RECORD_WRITER_ACCOUNTS: dict[str, tuple[str, ...]] = {
    A.DEVICE_ALLOCATED: (EXTENDER_SA,),
    A.DEVICE_ASSIGNED: (NODE_SA,),
    RECORD_SIGNATURE: (EXTENDER_SA,),
    ACK_SIGNATURE: (NODE_SA,),
}
# Every kubegpu.io/device-* key is kubegpu's: the ones above by their writer, any other (no meaning today, but
# a name a later kubegpu may give one) by kubegpu's own accounts only, never by anyone else.
RECORD_PREFIX = "kubegpu.io/device-"
# The kubegpu.io annotations a pod's author may set (model.annotations), named where a key is not known.
POD_ANNOTATIONS = (A.GPU_MODEL, A.REQUIRE_NVLINK, A.NODE_POLICY, A.GPU_POLICY)
DEFAULT_SCHEDULERS = frozenset({"", "default-scheduler"})


def default_record_writers(namespace: str, record: str | None = None) -> frozenset[str]:
    """The users that may write ``record`` (either record when None) by default."""
    ns = namespace or "kubegpu-system"
    if record is not None and record not in RECORD_WRITER_ACCOUNTS:
        record = None  # a device-* key without a writer of its own: either of kubegpu's accounts
    return frozenset(f"system:serviceaccount:{ns}:{sa}" for key, accounts in RECORD_WRITER_ACCOUNTS.items()
                     if record in (None, key) for sa in accounts)


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """What the webhook does besides the rules: scope and the normalisation policy.

    ``record_writers``: the users (``userInfo.username``) that may set or change kubegpu's record
    annotations on a pod (None: per record, kubegpu's service accounts in ``own_namespace`` that write it).
    ``scheduler_name``: in full mode, GPU pods left to the default scheduler are given this one.
    ``max_gpu_containers``: pods with more GPU containers are refused (the extender's cap)."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    own_namespace: str = ""
    exclude_namespaces: frozenset[str] = frozenset({"kube-system"})
    record_writers: frozenset[str] | None = None
    scheduler_name: str = ""
    max_gpu_containers: int = DEFAULT_MAX_GPU_CONTAINERS

    def excluded(self, namespace: str) -> bool:
        return bool(namespace) and (namespace == self.own_namespace or namespace in self.exclude_namespaces)

    def may_write_records(self, username: str, records: Iterable[str]) -> bool:
        if self.record_writers is not None:
            return username in self.record_writers
        return all(username in default_record_writers(self.own_namespace, r) for r in records)


@dataclass(slots=True)
class WebhookMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    reviews: Counter = field(init=False)
    latency: Histogram = field(init=False)
    cert_reloads: Counter = field(init=False)
    cert_not_after: Gauge = field(init=False)

    def __post_init__(self) -> None:
        self.reviews = Counter("kubegpu_webhook_reviews",
                               "Admission reviews answered, by verdict and reason.",
                               ("endpoint", "verdict", "reason"), registry=self.registry)
        self.latency = Histogram("kubegpu_webhook_review_seconds", "Time to answer one admission review.",
                                 ("endpoint",), registry=self.registry,
                                 buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                                          0.5, 1.0))
        self.cert_reloads = Counter("kubegpu_webhook_cert_reloads", "Serving-certificate reloads, by result.",
                                    ("result",), registry=self.registry)
        self.cert_not_after = Gauge("kubegpu_webhook_cert_not_after_seconds",
                                    "Expiry of the served certificate (Unix time).", registry=self.registry)


@dataclass(frozen=True, slots=True)
class Verdict:
    body: bytes
    verdict: str  # allowed, patched, denied
    reason: str  # the first refusal's code, or why nothing was done


def _message(refusals: Iterable[object]) -> str:
    return "\n".join(str(r) for r in refusals)


def decide(body: bytes, settings: WebhookSettings, *, mutate: bool) -> Verdict:
    """One AdmissionReview body in, the response body and the metric labels out.
    Raises :class:`BadReview` for a body that is not an AdmissionReview."""
    req = read_review(body)
    if req.object is not None and req.kind in ("ResourceClaim", "ResourceClaimTemplate"):
        # DRA claims naming kubegpu's DeviceClasses that no allocator could serve (docs/dra.md).
        from kubegpu.node.dra.claims import claim_problems

        problems = claim_problems({**req.object, "kind": req.kind}) if req.operation == "CREATE" else []
        if problems:
            return Verdict(write_response(req.uid, allowed=False, message="\n".join(problems)), "denied", "dra-claim")
        return Verdict(write_response(req.uid, allowed=True), "allowed", "dra-claim")
    if req.object is None or req.kind != "Pod":
        return Verdict(write_response(req.uid, allowed=True), "allowed", "not-a-pod")
    # Only kubegpu writes the records, in every namespace and on every path that can carry metadata.
    old = req.old_object if req.operation == "UPDATE" else None
    changed = _record_changes(req.object, old) if req.operation in ("CREATE", "UPDATE") else []
    if changed and not settings.may_write_records(req.username, changed):
        who = f"{_object_namespace(req.object) or req.namespace}/{_object_name(req.object)}"
        log.info("pod %s refused: %s may not write %s", who, req.username[:256] or "(unknown user)",
                 ", ".join(changed))
        return Verdict(write_response(req.uid, allowed=False, message=record_refusal(changed)), "denied",
                       "record-write")
    ephemeral = req.sub_resource == "ephemeralcontainers" and req.operation == "UPDATE"
    if req.sub_resource and not ephemeral:
        return Verdict(write_response(req.uid, allowed=True), "allowed", "subresource")
    if req.operation != "CREATE" and not ephemeral:
        return Verdict(write_response(req.uid, allowed=True), "allowed", "operation")
    namespace = req.namespace or _object_namespace(req.object)
    if settings.excluded(namespace):
        return Verdict(write_response(req.uid, allowed=True), "allowed", "excluded")
    if ephemeral:
        review = review_ephemeral(req.object, req.old_object, settings.policy)
    else:
        if why := too_many_gpu_containers(req.object, settings.max_gpu_containers,
                                          settings.policy.replica_resources):
            return Verdict(write_response(req.uid, allowed=False, message=why), "denied", "gpu-container-cap")
        policy = settings.policy
        if _node_name(req.object):
            # Created straight onto a node (no scheduler, no toleration needed): it may be a GPU node, so its
            # containers that ask for no GPU get NVIDIA_VISIBLE_DEVICES=void like any pod that can land there.
            policy = replace(policy, void_all_pods=True)
        review = review_pod(req.object, policy)
        if review.allowed and (why := unplaced_share(req.object, review.request, settings.scheduler_name)):
            log.info("pod %s/%s refused: %s", namespace, _object_name(req.object), why)
            return Verdict(write_response(req.uid, allowed=False, message=why), "denied", "share-not-placed")
    if not review.allowed:
        who = _object_name(req.object)
        log.info("pod %s/%s refused: %s", namespace, who, "; ".join(str(r) for r in review.refusals))
        return Verdict(write_response(req.uid, allowed=False, message=_message(review.refusals)),
                       "denied", review.refusals[0].code or "refused")
    reason = "gpu" if review.gpu_pod else "not-gpu"
    patch, warnings = list(review.patch), list(review.warnings)
    if mutate and not ephemeral and review.gpu_pod:  # said once, by the webhook that can act on it
        _steer(req.object, settings.scheduler_name, patch, warnings)
        warnings.extend(_env_from_warnings(req.object, settings.policy.replica_resources))
    if mutate and patch:
        return Verdict(write_response(req.uid, allowed=True, patch=patch, warnings=warnings), "patched", reason)
    return Verdict(write_response(req.uid, allowed=True, warnings=warnings if mutate else ()), "allowed", reason)


def _annotations(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return ann if isinstance(ann, Mapping) else {}


def record_refusal(changed: list[str]) -> str:
    """Why a pod may not set, change or remove the ``kubegpu.io/device-*`` keys ``changed``: kubegpu's records
    are its own, and a key of that prefix that is no record is most likely a misspelt one."""
    records = [k for k in changed if k in RECORD_WRITER_ACCOUNTS]
    unknown = [k[:96] for k in changed if k not in RECORD_WRITER_ACCOUNTS]
    out = []
    if records:
        out.append(f"{' and '.join(records)} {'is' if len(records) == 1 else 'are'} written only by kubegpu "
                   "(the scheduler extender records the GPUs it chose, the node daemon acknowledges them); "
                   "remove the annotation from the pod or its template")
    if unknown:
        what = "is not a kubegpu.io annotation" if len(unknown) == 1 else "are not kubegpu.io annotations"
        out.append(f"{' and '.join(unknown)} {what} kubegpu knows, and the {RECORD_PREFIX}* keys are reserved for "
                   f"its records ({', '.join(RECORD_WRITER_ACCOUNTS)}); a pod may set {', '.join(POD_ANNOTATIONS)}: "
                   "remove the annotation or correct its name")
    return "\n".join(out)


def _record_changes(obj: Mapping[str, Any], old: Mapping[str, Any] | None) -> list[str]:
    """The ``kubegpu.io/device-*`` annotations (records, their signatures, any other key of that prefix) this
    request sets, changes or removes."""
    new_ann, old_ann = _annotations(obj), _annotations(old)
    keys = sorted({str(k) for k in (*new_ann, *old_ann) if str(k).startswith(RECORD_PREFIX)})
    return [k for k in keys if new_ann.get(k) != old_ann.get(k)]


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _node_name(obj: Mapping[str, Any]) -> str:
    name = _spec(obj).get("nodeName")
    return name if isinstance(name, str) else ""


def _steer(obj: Mapping[str, Any], scheduler: str, patch: list[dict[str, Any]], warnings: list[str]) -> None:
    """In full mode a GPU pod left to the default scheduler goes to kubegpu's (placed, accounted)."""
    if not scheduler or _node_name(obj):
        return
    current = _spec(obj).get("schedulerName")
    if current is None or current in DEFAULT_SCHEDULERS:
        patch.append({"op": "add", "path": "/spec/schedulerName", "value": scheduler})
        warnings.append(f"spec.schedulerName set to {scheduler} (GPU pods are placed by kubegpu)")
    elif current != scheduler and isinstance(current, str):
        warnings.append(f"spec.schedulerName is {current[:64]!r}: kubegpu neither places nor accounts this "
                        f"pod's GPUs ({scheduler} does)")


def unplaced_share(pod: Mapping[str, Any], request: PodRequest, scheduler: str) -> str:
    """Why a pod asking GPU shares would only fail at its node ("" when it would not): a node serves a share
    only as the record kubegpu's scheduler writes when it binds the pod, so a share pod created onto a
    node or left to another scheduler never runs, and while it waits to be refused its identity-less
    Allocate call could be taken for a recorded pod's (docs/handoff.md). Full mode only (``scheduler``)."""
    if not scheduler or not any(c.request is not None and device_resource(c.request) == R.GPU_SLOTS
                                for c in request.gpu_containers):
        return ""
    what = (f"GPU shares ({', '.join(R.SHARE_RESOURCES)}) are served only to pods {scheduler} places: a node "
            "serves a share only as the record it writes at bind")
    if node := _node_name(pod):
        return (f"{what}, and spec.nodeName is set ({node[:64]!r}), so the pod would fail on that node; leave "
                f"nodeName out and pin the pod with a nodeSelector or node affinity instead")
    current = _spec(pod).get("schedulerName")
    if not isinstance(current, str) or current in DEFAULT_SCHEDULERS or current == scheduler:
        return ""
    return (f"{what}, and spec.schedulerName is {current[:64]!r}, so the pod would fail on its node; leave "
            f"schedulerName out (kubegpu's webhook sets {scheduler}) or set it to {scheduler}")


def offline_warnings(pod: Mapping[str, Any], settings: WebhookSettings) -> list[str]:
    """What the webhook would add or refuse beyond :func:`review_pod`, for ``kubegpu check``: the
    scheduler name of GPU pods, the GPU-container cap, the record annotations and envFrom."""
    out: list[str] = []
    if why := too_many_gpu_containers(pod, settings.max_gpu_containers, settings.policy.replica_resources):
        out.append(f"refused by the webhook: {why}")
    if changed := _record_changes(pod, None):
        out.extend(f"refused by the webhook: {line}" for line in record_refusal(changed).splitlines())
    if unplaced := unplaced_share(pod, parse_pod(pod, replica_resources=settings.policy.replica_resources),
                                  settings.scheduler_name):
        out.append(f"refused by the webhook: {unplaced}")
    if count_gpu_containers(pod, settings.policy.replica_resources) and settings.scheduler_name \
            and not _node_name(pod) and not unplaced:
        current = _spec(pod).get("schedulerName")
        if current is None or current in DEFAULT_SCHEDULERS:
            out.append(f"spec.schedulerName is {current or 'not set'}: without kubegpu's webhook (full mode sets "
                       f"{settings.scheduler_name}) the default scheduler places this pod and knows nothing of "
                       "GPU shares")
        elif current != settings.scheduler_name:
            out.append(f"spec.schedulerName is {str(current)[:64]!r}: kubegpu neither places nor accounts "
                       "this pod's GPUs")
    out.extend(_env_from_warnings(pod, settings.policy.replica_resources))
    return out


def _env_from_warnings(obj: Mapping[str, Any], replica_resources: frozenset[str]) -> list[str]:
    """GPU containers whose envFrom could set a device variable: admission cannot see a ConfigMap's or
    Secret's keys, and the pod's own environment overrides the device plugin's."""
    out = []
    spec = _spec(obj)
    for key in ("initContainers", "containers"):
        items = spec.get(key)
        for c in items if isinstance(items, list) else ():
            if not isinstance(c, Mapping) or not isinstance(c.get("envFrom"), list) or \
                    count_gpu_containers({"spec": {"containers": [c]}}, replica_resources) == 0:
                continue
            prefixes = [e.get("prefix") or "" for e in c["envFrom"] if isinstance(e, Mapping)]
            if any(isinstance(p, str) and any(v.startswith(p) for v in DEVICE_ENV_VARS) for p in prefixes):
                raw = c.get("name")
                name = raw if isinstance(raw, str) else "?"
                out.append(f"container {name[:64]!r}: envFrom may set NVIDIA_VISIBLE_DEVICES, which admission "
                           "cannot see; nodes must run the NVIDIA runtime with "
                           "accept-nvidia-visible-devices-envvar-when-unprivileged = false (docs/security.md)")
    return out


def _object_namespace(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    ns = meta.get("namespace") if isinstance(meta, Mapping) else None
    return ns if isinstance(ns, str) else ""


def _object_name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return "?"
    name = meta.get("name") or meta.get("generateName") or "?"
    return name if isinstance(name, str) else "?"


def create_app(settings: WebhookSettings, metrics: WebhookMetrics | None = None,
               limits: ServeLimits | None = None) -> ASGIApp:
    """The webhook's ASGI app. The API server POSTs a review for every pod created (thousands a second
    in a busy cluster): ``/mutate`` and ``/validate`` are answered straight from ASGI, without
    Starlette's routing, middleware and request object, which cost as much as the review; the rest
    (metrics, health, a wrong method: 405) goes through Starlette."""
    metrics = metrics or WebhookMetrics()
    limits = limits or ServeLimits(max_body_bytes=MAX_BODY_BYTES)

    def endpoint(mutate: bool) -> Callable[[Scope, Receive], Awaitable[Response]]:
        label = "mutate" if mutate else "validate"
        reviews = metrics.reviews
        latency = metrics.latency.labels(label)

        async def handle(scope: Scope, receive: Receive) -> Response:
            start = time.perf_counter()
            try:
                body = await receive_body(scope, receive, limits.max_body_bytes, limits.body_timeout_s)
                verdict = decide(body, settings, mutate=mutate)
            except BodyError as exc:
                reviews.labels(label, "error", f"http-{exc.status}").inc()
                if exc.status == 499:
                    log.info("admission review: %s", exc)  # nobody is left to answer
                return Response(encode_json({"error": str(exc)}), status_code=exc.status, media_type=_JSON,
                                headers={"connection": "close"})
            except BadReview as exc:
                reviews.labels(label, "error", "bad-request").inc()
                return Response(encode_json({"error": str(exc)}), status_code=400, media_type=_JSON)
            except Exception:  # a bug must cost one answer, never the process
                log.exception("admission review failed")
                reviews.labels(label, "error", "internal").inc()
                return Response(encode_json({"error": "internal error"}), status_code=500, media_type=_JSON)
            reviews.labels(label, verdict.verdict, verdict.reason).inc()
            latency.observe(time.perf_counter() - start)
            return Response(verdict.body, media_type=_JSON)

        return handle

    async def metrics_endpoint(_request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_request: Request) -> Response:
        return Response(b"ok", media_type="text/plain")

    reviews = {"/mutate": endpoint(True), "/validate": endpoint(False)}

    def routed(handle: Callable[[Scope, Receive], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def via_starlette(request: Request) -> Response:
            return await handle(request.scope, request.receive)
        return via_starlette

    routes = [
        *(Route(path, routed(handle), methods=["POST"]) for path, handle in reviews.items()),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", healthz, methods=["GET"]),
    ]
    rest = Starlette(routes=routes)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        handle = reviews.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handle is None:
            await rest(scope, receive, send)
            return
        response = await handle(scope, receive)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})

    return app
