"""Same rules offline: every case of the webhook's admission table goes through ``kubegpu check``
and through the webhook over HTTPS; the verdicts, the refusal messages and the normalised requests
must be the same."""

from __future__ import annotations

import base64
import copy
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.model import parse_pod
from kubegpu.model.normalise import request_summary
from kubegpu.webhook.app import WebhookSettings
from kubegpu.webhook.certs import generate_ca, issue_serving_cert
from kubegpu.webhook.server import WebhookServer

CASES_FILE = Path(__file__).parents[1] / "webhook" / "admission_cases.yaml"
CASES = [c for c in yaml.safe_load(CASES_FILE.read_text()) if not c.get("webhook_only")]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    d = tmp_path_factory.mktemp("parity-tls")
    ca = generate_ca()
    (d / "ca.crt").write_bytes(ca.cert_pem)
    issue_serving_cert(ca, ["127.0.0.1"]).write(d / "tls.crt", d / "tls.key")
    server = WebhookServer(WebhookSettings(), str(d / "tls.crt"), str(d / "tls.key"))
    server.start()
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    with httpx.Client(base_url=f"https://127.0.0.1:{server.port}", verify=ctx, timeout=10) as c:
        yield c
    server.stop()


def case_pod(case: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": case["id"], "namespace": "team-a", **(
        {"annotations": case["annotations"]} if "annotations" in case else {})}
    spec: dict[str, Any] = {"containers": [{"image": "busybox", **c} for c in case["containers"]]}
    for key in ("initContainers", "tolerations"):
        if key in case:
            spec[key] = case[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def webhook_verdict(client: httpx.Client, pod: dict[str, Any]) -> dict[str, Any]:
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "namespace": "team-a", "operation": "CREATE", "object": pod}}
    r = client.post("/mutate", json=review)
    assert r.status_code == 200
    return r.json()["response"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_check_and_webhook_agree(client: httpx.Client, case: dict[str, Any], tmp_path: Path) -> None:
    pod = case_pod(case)
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    result = CliRunner().invoke(app, ["check", str(path), "--json"])
    report = json.loads(result.output)
    (obj,) = report["objects"]

    response = webhook_verdict(client, copy.deepcopy(pod))
    assert response["allowed"] is obj["allowed"] is (case["expect"] == "allow")
    assert result.exit_code == (0 if response["allowed"] else 1)
    if not response["allowed"]:
        assert response["status"]["message"].splitlines() == [r["message"] for r in obj["refusals"]]
        return
    patched = copy.deepcopy(pod)
    if "patch" in response:
        ops = json.loads(base64.b64decode(response["patch"]))
        assert ops == obj["patch"]
        patched = jsonpatch.apply_patch(patched, ops)
    else:
        assert obj["patch"] == []
    assert request_summary(parse_pod(patched)) == obj["containers"]
    assert response.get("warnings", []) == obj["warnings"]
