"""Certificate rotation without restart: new files on disk are served on the next handshake; a
broken pair is refused and the last good one stays in service."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from polling import until

from kubegpu.webhook.app import WebhookSettings
from kubegpu.webhook.certs import generate_ca, issue_serving_cert
from kubegpu.webhook.server import WebhookServer


def served_serial(port: int, ca_file: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def reload_errors(server: WebhookServer) -> float:
    value = server.metrics.registry.get_sample_value("kubegpu_webhook_cert_reloads_total", {"result": "error"})
    return value or 0.0


@pytest.fixture
def rotating(tmp_path: Path) -> Iterator[tuple[WebhookServer, Path, object]]:
    ca = generate_ca()
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    issue_serving_cert(ca, ["127.0.0.1"]).write(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = WebhookServer(WebhookSettings(), str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"),
                           cert_poll_s=0.05)
    server.start()
    yield server, tmp_path, ca
    server.stop()


def test_rotated_files_are_served_without_restart(rotating: tuple[WebhookServer, Path, object]) -> None:
    server, d, ca = rotating
    first = served_serial(server.port, d / "ca.crt")
    new = issue_serving_cert(ca, ["127.0.0.1"])  # type: ignore[arg-type]
    new.write(d / "tls.crt", d / "tls.key")
    expected = x509.load_pem_x509_certificate(new.cert_pem).serial_number
    assert expected != first
    assert until(lambda: served_serial(server.port, d / "ca.crt") == expected, 20, 0.05)


def test_rotation_through_a_swapped_symlink(tmp_path: Path) -> None:
    """Kubernetes updates a mounted Secret by re-pointing the ``..data`` symlink."""
    ca = generate_ca()
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    issue_serving_cert(ca, ["127.0.0.1"]).write(v1 / "tls.crt", v1 / "tls.key")
    second = issue_serving_cert(ca, ["127.0.0.1"])
    second.write(v2 / "tls.crt", v2 / "tls.key")
    (tmp_path / "..data").symlink_to("v1")
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    server = WebhookServer(WebhookSettings(), str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"),
                           cert_poll_s=0.05)
    server.start()
    try:
        (tmp_path / "..data_tmp").symlink_to("v2")
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")
        expected = x509.load_pem_x509_certificate(second.cert_pem).serial_number
        assert until(lambda: served_serial(server.port, tmp_path / "ca.crt") == expected, 20, 0.05)
    finally:
        server.stop()


def test_broken_pair_keeps_the_last_good_certificate(rotating: tuple[WebhookServer, Path, object]) -> None:
    server, d, ca = rotating
    good = served_serial(server.port, d / "ca.crt")
    (d / "tls.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot a certificate\n")
    assert until(lambda: reload_errors(server) >= 1, 20, 0.05)
    assert served_serial(server.port, d / "ca.crt") == good
    # A mismatched key is refused as well.
    other = issue_serving_cert(ca, ["127.0.0.1"])  # type: ignore[arg-type]
    (d / "tls.crt").write_bytes(other.cert_pem)
    assert until(lambda: reload_errors(server) >= 2, 20, 0.05)
    assert served_serial(server.port, d / "ca.crt") == good
    # Then a complete pair is picked up.
    other.write(d / "tls.crt", d / "tls.key")
    expected = x509.load_pem_x509_certificate(other.cert_pem).serial_number
    assert until(lambda: served_serial(server.port, d / "ca.crt") == expected, 20, 0.05)


def test_handshakes_during_rotations_all_succeed(rotating: tuple[WebhookServer, Path, object]) -> None:
    """A handshake that starts while a new pair is being loaded gets the old pair or the new one, whole.

    Loading into the live context would let a handshake start between its certificate and its key (new
    certificate, old key: the client sees the connection closed).
    """
    server, d, ca = rotating
    pairs = [issue_serving_cert(ca, ["127.0.0.1"]) for _ in range(2)]  # type: ignore[arg-type]
    serials = {x509.load_pem_x509_certificate(p.cert_pem).serial_number for p in pairs}
    serials.add(served_serial(server.port, d / "ca.crt"))
    failures: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def handshake_loop() -> None:
        while not done.is_set():
            try:
                seen.add(served_serial(server.port, d / "ca.crt"))
            except (OSError, ssl.SSLError) as e:
                failures.append(e)

    t = threading.Thread(target=handshake_loop)
    t.start()
    try:
        for i in range(40):
            pairs[i % 2].write(d / "tls.crt", d / "tls.key")
            server.reloader.check()
    finally:
        done.set()
        t.join()
    assert failures == []
    assert seen <= serials
