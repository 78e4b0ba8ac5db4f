"""Admission webhook latency and throughput over HTTPS on loopback.

Starts ``kubegpu webhook`` in its own process (so the client does not share its
interpreter), with a freshly generated CA and serving certificate, and sends
AdmissionReview v1 requests for a GPU pod (normalised: patch) and for a plain
pod (no patch) over one keep-alive HTTPS connection. Prints one JSON object as
its last line: per pod kind, ``p50_ms``, ``p99_ms``, ``reviews_per_s`` and ``server_cpu_us_per_review`` (the
webhook process's CPU per review, from its CPU clock: what other work on the machine changes least), and
``load_avg`` (the machine's 1-minute load before and after).
Targets : p99 <= 1 ms, >= 2,500 reviews/s for plain pods and >= 2,000 for GPU pods.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubegpu.webhook.certs import generate_ca, issue_serving_cert

GPU_POD = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"},
    "spec": {"containers": [
        {"name": "trainer", "image": "cuda", "resources": {"limits": {"cpu": "4", "memory": "16Gi"},
                                                          "requests": {"kubernetes.io/gpu-core": "50",
                                                                       "kubernetes.io/gpu-memory": "8Gi"}}},
        {"name": "logger", "image": "fluent-bit", "env": [{"name": "LEVEL", "value": "info"}]},
    ]},
}
PLAIN_POD = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "shop"},
    "spec": {"containers": [
        {"name": "nginx", "image": "nginx", "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
         "env": [{"name": "PORT", "value": "8080"}], "ports": [{"containerPort": 8080}]},
    ]},
}


def review(pod: dict[str, Any], uid: str) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": pod["metadata"]["namespace"], "operation": "CREATE",
        "userInfo": {"username": "bench"}, "object": pod}}).encode()


def start_server(tmp: Path) -> tuple[subprocess.Popen[str], int]:
    ca = generate_ca()
    (tmp / "ca.crt").write_bytes(ca.cert_pem)
    issue_serving_cert(ca, ["127.0.0.1"]).write(tmp / "tls.crt", tmp / "tls.key")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kubegpu.cli.main import app; app()", "webhook", "--listen", "127.0.0.1:0",
         "--tls-cert", str(tmp / "tls.crt"), "--tls-key", str(tmp / "tls.key"), "--log-level", "info"],
        stderr=subprocess.PIPE, text=True)
    # The port is only known once bound: the command logs it at info.
    deadline = time.monotonic() + 30
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("webhook exited")
        m = re.search(r"serving https://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise RuntimeError("webhook did not start")


def connect(port: int, ca_file: Path) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    conn.connect()
    # TCP_NODELAY as the API server's Go client has it (http.client already sends header and body
    # in one write, so this only matters for the TLS records).
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def post(conn: http.client.HTTPSConnection, body: bytes) -> dict[str, Any]:
    conn.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"unexpected answer: {r.status} {data[:200]!r}")
    return json.loads(data)


def cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time (nanosecond resolution) for :func:`time.clock_gettime`."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock = ctypes.c_int()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(ctypes.get_errno(), f"clock_getcpuclockid({pid})")
    return clock.value


def measure(conn: http.client.HTTPSConnection, pod: dict[str, Any], n: int, warmup: int,
            clock: int) -> dict[str, float]:
    bodies = [review(pod, f"u{i}") for i in range(n + warmup)]
    for body in bodies[:warmup]:
        post(conn, body)
    latencies = []
    cpu = time.clock_gettime(clock)
    start = time.perf_counter()
    for body in bodies[warmup:]:
        t0 = time.perf_counter()
        answer = post(conn, body)
        latencies.append(time.perf_counter() - t0)
        if answer["response"]["allowed"] is not True:
            raise RuntimeError(f"refused: {answer}")
    total = time.perf_counter() - start
    cpu = time.clock_gettime(clock) - cpu
    latencies.sort()
    return {
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
        "reviews_per_s": round(n / total, 1),
        "server_cpu_us_per_review": round(1e6 * cpu / n, 1),
    }


def server_side(conn: http.client.HTTPSConnection) -> dict[str, float]:
    """p50/p99 of the time inside the handler, from the webhook's own latency histogram."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    buckets = []
    for line in text.splitlines():
        m = re.match(r'kubegpu_webhook_review_seconds_bucket\{endpoint="mutate",le="([^"]+)"\} (\S+)', line)
        if m:
            buckets.append((float(m.group(1)), float(m.group(2))))
    total = buckets[-1][1]

    def quantile(q: float) -> float:
        return next(le for le, count in buckets if count >= q * total) * 1000

    return {"p50_ms_at_most": quantile(0.5), "p99_ms_at_most": quantile(0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000, help="reviews per pod kind")
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, port = start_server(tmp)
        try:
            conn = connect(port, tmp / "ca.crt")
            clock = cpu_clock(proc.pid)
            load = os.getloadavg()[0]
            gpu = measure(conn, GPU_POD, args.n, args.warmup, clock)
            plain = measure(conn, PLAIN_POD, args.n, args.warmup, clock)
            handler = server_side(conn)
            conn.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    result = {
        "plain_pod": plain,
        "gpu_pod": gpu,
        "p50_ms": plain["p50_ms"],
        "p99_ms": max(plain["p99_ms"], gpu["p99_ms"]),
        "reviews_per_s": plain["reviews_per_s"],
        "n": args.n,
        "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)],
        "handler_time_buckets": handler,
        "transport": "HTTPS (TLS 1.3) keep-alive, one connection, sequential, 127.0.0.1, http.client",
        "targets": {"p99_ms": 1.0, "plain_reviews_per_s": 2500, "gpu_reviews_per_s": 2000},
        "meets_targets": max(plain["p99_ms"], gpu["p99_ms"]) <= 1.0 and plain["reviews_per_s"] >= 2500
        and gpu["reviews_per_s"] >= 2000,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
