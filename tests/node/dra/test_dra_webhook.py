"""The webhook admits pods with resourceClaims and refuses claims naming kubegpu's classes that could never
be allocated; ``manifests --dra`` routes claims to it (full mode)."""

from __future__ import annotations

import json
from typing import Any

from dra_harness import fixture, strip_server

from kubegpu.install.dra import apply_dra
from kubegpu.install.render import render
from kubegpu.install.values import Values
from kubegpu.webhook.app import WebhookSettings, decide

SETTINGS = WebhookSettings(own_namespace="kubegpu-system", scheduler_name="kubegpu-scheduler")


def _review(obj: dict[str, Any], kind: str, op: str = "CREATE") -> dict[str, Any]:
    group = "" if kind == "Pod" else "resource.k8s.io"
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"group": group, "version": "v1", "kind": kind},
                        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
                        "namespace": "default", "operation": op, "userInfo": {"username": "alice"},
                        "object": obj}}
    return json.loads(decide(json.dumps(body).encode(), SETTINGS, mutate=False).body)["response"]


def test_pod_with_resource_claims_is_admitted() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}],
                    "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]}}
    assert _review(pod, "Pod")["allowed"] is True


def test_claims_are_checked() -> None:
    assert _review(strip_server(fixture("s1-resourceclaimtemplate.json")), "ResourceClaimTemplate")["allowed"]
    assert _review(strip_server(fixture("s4-claim-slice-1.json")), "ResourceClaim")["allowed"]
    bad = strip_server(fixture("s4-claim-slice-bad.json"))
    assert bad["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["compute"] == "150"
    resp = _review(bad, "ResourceClaim")
    assert resp["allowed"] is False and "could never be allocated" in resp["status"]["message"]
    assert _review(bad, "ResourceClaim", op="UPDATE")["allowed"] is True  # only creation is checked


def test_manifests_route_claims_to_the_webhook_in_full_mode() -> None:
    v = Values()
    hooks = [o for o in apply_dra(render(v), v) if o["kind"] == "ValidatingWebhookConfiguration"]
    claims = next(h for h in hooks if h["metadata"]["name"] == "kubegpu-dra-claims")["webhooks"][0]
    assert claims["rules"][0]["resources"] == ["resourceclaims", "resourceclaimtemplates"]
    assert claims["failurePolicy"] == "Ignore" and claims["clientConfig"]["service"]["path"] == "/validate"
    v.mode = "node-only"
    assert not any(o["metadata"]["name"] == "kubegpu-dra-claims" for o in apply_dra(render(v), v))
