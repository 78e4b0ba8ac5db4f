"""Arbitrary JSON where a pod should be: the review answers (allowed or refused) or says 400,
and never raises anything else."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.webhook.app import WebhookSettings, decide
from kubegpu.webhook.review import BadReview

KEYS = ["spec", "containers", "initContainers", "ephemeralContainers", "resources", "limits", "requests",
        "env", "name", "value", "valueFrom", "securityContext", "privileged", "tolerations", "key", "operator",
        "effect", "metadata", "annotations", "volumeMounts", "mountPath", "nvidia.com/gpu", "kubegpu.io/gpu",
        "kubernetes.io/gpu-memory", "NVIDIA_VISIBLE_DEVICES", "cdi.k8s.io/x", "nvidia.com/mig-1g.10gb"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["1", "0.5", "8Gi", "all", "void", "Exists", "NoSchedule", "1e9", "-1", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=5),
    max_leaves=30,
)


@given(obj=json_values, operation=st.sampled_from(["CREATE", "UPDATE"]),
       sub=st.sampled_from(["", "ephemeralcontainers", "status"]), mutate=st.booleans())
@settings(max_examples=400, deadline=None)
def test_any_object_gets_an_answer(obj: Any, operation: str, sub: str, mutate: bool) -> None:
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"kind": "Pod"}, "namespace": "n", "operation": operation, "subResource": sub,
        "object": obj, "oldObject": obj}}).encode()
    verdict = decide(body, WebhookSettings(), mutate=mutate)
    response = json.loads(verdict.body)["response"]
    assert response["uid"] == "u" and isinstance(response["allowed"], bool)
    assert verdict.verdict in ("allowed", "patched", "denied")


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@settings(max_examples=300, deadline=None)
def test_any_body_is_an_answer_or_a_bad_review(body: bytes) -> None:
    with contextlib.suppress(BadReview):
        decide(body, WebhookSettings(), mutate=True)
