"""Admission as the demo (and the API server) does it, against the real webhook over HTTPS: /mutate's
JSON patch is applied, /validate has the last word, refusals carry the webhook's reason, and a
broken webhook is an error, never a silent admission."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kubegpu.demo.admission import AdmissionError, admit, review
from kubegpu.demo.pods import first_wave
from kubegpu.webhook.app import WebhookSettings
from kubegpu.webhook.certs import generate_ca, issue_serving_cert
from kubegpu.webhook.server import WebhookServer


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, httpx.Client]]:
    root: Path = tmp_path_factory.mktemp("tls")
    ca = generate_ca()
    (root / "ca.crt").write_bytes(ca.cert_pem)
    issue_serving_cert(ca, ["127.0.0.1"]).write(root / "tls.crt", root / "tls.key")
    server = WebhookServer(WebhookSettings(own_namespace="kubegpu-system"), str(root / "tls.crt"),
                           str(root / "tls.key"))
    server.start()
    with httpx.Client(verify=ssl.create_default_context(cafile=str(root / "ca.crt")), timeout=10) as http:
        yield f"https://127.0.0.1:{server.port}", http
    server.stop()


def _pod(name: str) -> dict:
    return dict(next(p for p in first_wave() if p.name == name).manifest)


def test_alias_is_rewritten_by_the_applied_patch(webhook: tuple[str, httpx.Client]) -> None:
    url, http = webhook
    a = admit(http, url, _pod("share-core-ratio"))
    assert a.allowed and a.patch
    res = a.pod["spec"]["containers"][0]["resources"]
    assert res["limits"] == res["requests"] == {"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory-ratio": "50",
                                                "kubegpu.io/gpu.shared": "1"}
    assert _pod("share-core-ratio")["spec"]["containers"][0]["resources"].get("limits") is None  # input untouched


def test_plain_pod_that_tolerates_the_gpu_taint_gets_void(webhook: tuple[str, httpx.Client]) -> None:
    url, http = webhook
    a = admit(http, url, _pod("plain"))
    assert a.allowed
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in a.pod["spec"]["containers"][0]["env"]


def test_refusal_names_container_resource_and_rule(webhook: tuple[str, httpx.Client]) -> None:
    url, http = webhook
    a = admit(http, url, _pod("core-only"))
    assert not a.allowed
    assert "container 'main'" in a.message and "gpu-core" in a.message and "memory" in a.message


def test_every_first_wave_pod_gets_its_expected_verdict(webhook: tuple[str, httpx.Client]) -> None:
    url, http = webhook
    for dp in first_wave():
        assert admit(http, url, dict(dp.manifest)).allowed is not dp.refused, dp.name


def test_broken_webhook_is_an_error(webhook: tuple[str, httpx.Client]) -> None:
    url, http = webhook
    with pytest.raises(AdmissionError, match="HTTP 404"):
        admit(http, url + "/nowhere", _pod("plain"))
    with pytest.raises(AdmissionError):
        admit(http, "https://127.0.0.1:1", _pod("plain"))


def test_review_is_an_admission_v1_create() -> None:
    body = review({"metadata": {"name": "p"}}, namespace="ns")
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    req = body["request"]
    assert req["operation"] == "CREATE" and req["namespace"] == "ns" and req["kind"]["kind"] == "Pod"
    assert req["uid"] != review({"metadata": {"name": "p"}}, namespace="ns")["request"]["uid"]
