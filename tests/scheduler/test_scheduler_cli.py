"""``kubegpu scheduler`` as deployed: a process serving the verbs (HTTPS here), with a separate metrics listener."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sched_harness import fixture_inventories, fixture_nodes

from kubegpu.model.device_object import device_object
from kubegpu_standins.apiserver import ApiServer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return tmp / "tls.crt", tmp / "tls.key"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from kubegpu.cli.main import app; app()", "scheduler", *args]


def test_scheduler_process_serves_https_and_metrics(tmp_path: Path) -> None:
    api = ApiServer().start()
    for node in fixture_nodes():
        api.put_object(node)
    for inv in fixture_inventories():
        api.put_object(device_object(inv))
    kc = api.write_kubeconfig(tmp_path / "kc")
    cert, key = _self_signed(tmp_path)
    port, mport = _port(), _port()
    proc = subprocess.Popen(_cli("--kubeconfig", str(kc), "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert),
                                 "--tls-key", str(key), "--metrics-listen", f"127.0.0.1:{mport}",
                                 "--node-policy", "bestfit", "--filter-wait-seconds", "0.5"))
    try:
        https = httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{mport}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "extender did not get ready"
            time.sleep(0.1)
        pod = {"metadata": {"name": "p", "namespace": "default"},
               "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}}
        r = https.post("/scheduler/filter", json={"Pod": pod, "Nodes": None, "NodeNames": ["gpu-node-a", "gpu-node-c"]})
        assert r.status_code == 200 and r.json()["NodeNames"] == ["gpu-node-a"]
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'kubegpu_extender_request_seconds_count{verb="filter"} 1.0' in metrics
        assert 'kubegpu_filter_inflight_total{outcome="unchecked"} 1.0' in metrics  # nothing else was in flight
        assert httpx.post(f"http://127.0.0.1:{mport}/filter", json={}).status_code in (404, 405)  # verbs not here
    finally:
        proc.terminate()
        proc.wait(10)
        api.stop()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    for args in (["--listen", "nowhere"], ["--gpu-policy", "fastest"], ["--filter-wait-seconds", "9"],
                 ["--tls-cert", str(tmp_path / "x")],
                 ["--kubeconfig", str(tmp_path / "missing"), "--listen", "127.0.0.1:0"]):
        r = subprocess.run(_cli(*args), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


def test_a_taken_port_is_one_clear_line(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run(_cli("--kubeconfig", str(tmp_path / "unused"), "--listen", f"127.0.0.1:{port}"),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
