"""Fixtures for the webhook tests: a generated CA and serving certificate, the webhook served
over HTTPS on an ephemeral loopback port, and a client that trusts only that CA."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kubegpu.webhook.app import WebhookSettings
from kubegpu.webhook.certs import KeyPair, generate_ca, issue_serving_cert
from kubegpu.webhook.server import WebhookServer


class Tls:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = generate_ca()
        (root / "ca.crt").write_bytes(self.ca.cert_pem)
        self.cert, self.key = root / "tls.crt", root / "tls.key"
        self.issue().write(self.cert, self.key)

    def issue(self) -> KeyPair:
        return issue_serving_cert(self.ca, ["localhost", "127.0.0.1"])

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.root / "ca.crt"))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return Tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def webhook(tls: Tls) -> Iterator[WebhookServer]:
    settings = WebhookSettings(own_namespace="kubegpu-system", exclude_namespaces=frozenset({"kube-system"}))
    server = WebhookServer(settings, str(tls.cert), str(tls.key), cert_poll_s=0.1)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tls: Tls, webhook: WebhookServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"https://127.0.0.1:{webhook.port}", verify=tls.client_context(),
                      timeout=10) as c:
        yield c
