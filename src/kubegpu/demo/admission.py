"""Admission as the API server does it: AdmissionReview to the webhook over HTTPS, then the patch.

A pod is sent to ``/mutate``; an allowed answer's JSON patch (base64, ``JSONPatch``) is applied
to the object; the result goes to ``/validate``, which has the last word. Only then is the pod
created. A refusal carries the webhook's message (which names container, resource, value and rule).
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonpatch


@dataclass(slots=True)
class Admission:
    allowed: bool
    pod: dict[str, Any]  # the object as it would be stored (patched)
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class AdmissionError(RuntimeError):
    """The webhook could not be asked (transport error, non-200, malformed answer)."""


def review(pod: Mapping[str, Any], *, namespace: str) -> dict[str, Any]:
    """The ``admission.k8s.io/v1`` request body for creating ``pod``."""
    meta = pod.get("metadata") or {}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": meta.get("name", ""), "namespace": namespace, "operation": "CREATE",
            "userInfo": {"username": "kubegpu-demo", "groups": ["system:authenticated"]},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def _ask(http: httpx.Client, url: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        resp = http.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        raise AdmissionError(f"webhook {url}: {exc}") from None
    if resp.status_code != 200:
        raise AdmissionError(f"webhook {url} answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        answer = resp.json()["response"]
    except (ValueError, KeyError, TypeError):
        raise AdmissionError(f"webhook {url}: not an AdmissionReview response: {resp.text[:200]}") from None
    if not isinstance(answer, Mapping):
        raise AdmissionError(f"webhook {url}: response is not an object")
    return answer


def admit(http: httpx.Client, webhook_url: str, pod: Mapping[str, Any]) -> Admission:
    """Run ``pod`` through /mutate then /validate; never raises for a refusal, only for a broken webhook."""
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    obj = copy.deepcopy(dict(pod))
    answer = _ask(http, f"{webhook_url}/mutate", review(obj, namespace=namespace))
    warnings = list(answer.get("warnings") or [])
    if not answer.get("allowed"):
        return Admission(False, obj, (answer.get("status") or {}).get("message", ""), warnings=warnings)
    ops: list[dict[str, Any]] = []
    if answer.get("patch"):
        if answer.get("patchType") != "JSONPatch":
            raise AdmissionError(f"webhook answered patchType {answer.get('patchType')!r}")
        ops = json.loads(base64.b64decode(answer["patch"]))
        try:
            obj = jsonpatch.apply_patch(obj, ops)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise AdmissionError(f"webhook patch does not apply: {exc}") from None
    final = _ask(http, f"{webhook_url}/validate", review(obj, namespace=namespace))
    warnings += list(final.get("warnings") or [])
    if not final.get("allowed"):
        return Admission(False, obj, (final.get("status") or {}).get("message", ""), ops, warnings)
    return Admission(True, obj, "", ops, warnings)
