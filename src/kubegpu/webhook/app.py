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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kubegpu.model.normalise import AdmissionPolicy, review_ephemeral, review_pod
from kubegpu.webhook.review import BadReview, encode_json, read_review, write_response

log = logging.getLogger(__name__)
_JSON = "application/json"


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """What the webhook does besides the rules: scope and the normalisation policy."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    own_namespace: str = ""
    exclude_namespaces: frozenset[str] = frozenset({"kube-system"})

    def excluded(self, namespace: str) -> bool:
        return bool(namespace) and (namespace == self.own_namespace or namespace in self.exclude_namespaces)


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
    if req.object is None or req.kind != "Pod":
        return Verdict(write_response(req.uid, allowed=True), "allowed", "not-a-pod")
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
        review = review_pod(req.object, settings.policy)
    if not review.allowed:
        who = _object_name(req.object)
        log.info("pod %s/%s refused: %s", namespace, who, "; ".join(str(r) for r in review.refusals))
        return Verdict(write_response(req.uid, allowed=False, message=_message(review.refusals)),
                       "denied", review.refusals[0].code or "refused")
    reason = "gpu" if review.gpu_pod else "not-gpu"
    if mutate and review.patch:
        return Verdict(write_response(req.uid, allowed=True, patch=review.patch, warnings=review.warnings),
                       "patched", reason)
    return Verdict(write_response(req.uid, allowed=True), "allowed", reason)


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


def create_app(settings: WebhookSettings, metrics: WebhookMetrics | None = None) -> Starlette:
    metrics = metrics or WebhookMetrics()

    def endpoint(mutate: bool):  # type: ignore[no-untyped-def]
        label = "mutate" if mutate else "validate"
        reviews = metrics.reviews
        latency = metrics.latency.labels(label)

        async def handle(request: Request) -> Response:
            start = time.perf_counter()
            try:
                body = await request.body()
                verdict = decide(body, settings, mutate=mutate)
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

    routes = [
        Route("/mutate", endpoint(True), methods=["POST"]),
        Route("/validate", endpoint(False), methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", healthz, methods=["GET"]),
    ]
    return Starlette(routes=routes)
