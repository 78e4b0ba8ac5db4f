"""Hostile-input benchmark : thousands of malformed, oversized, slow, concurrent and forged
requests against the three servers, each run as its own process the way it is deployed.

* the extender (``kubegpu scheduler``) watching a stand-in API server (its own process) with N nodes of
  8 GPUs and their Device objects: garbage and deeply nested bodies, wrong shapes, random pods,
  oversized, half-sent and abandoned bodies, headers that never end; then a 1,000-container pod at N
  nodes, a 1-GPU pod's filter while large pods are in flight, and 1,000 fat (~1 MiB) pods;
* the webhook (``kubegpu webhook``, HTTPS): the same kinds of bodies as AdmissionReviews, plus forged
  records and pods over the GPU-container cap;
* the device plugin (``kubegpu node --standalone`` registered with the stand-in kubelet over unix
  sockets): huge and unknown device IDs, absurd preferred sizes, then Allocate latency while 100 extra
  ListAndWatch streams are open, never read, on the same connection;
* the DRA driver (``kubegpu node --kubelet-plugin dra`` registered with the stand-in DRA kubelet):
  NodePrepareResources latency while 100 idle ``NodeWatchResources`` health streams are open on the same
  connection.

``server_errors`` counts HTTP 5xx, gRPC UNKNOWN/INTERNAL/DATA_LOSS and connections dropped without an
answer where one was due; ``tracebacks_logged`` counts tracebacks in the three servers' logs.
Prints one JSON object as its last line. Targets: server_errors 0, tracebacks_logged 0,
big_pod_filter_ms <= 1000 (N = 5,000), small_filter_p99_ms_during_big <= 100,
extender_rss_mb_after_1000_fat_pods <= 1024, allocate_p99_ms_with_100_streams <= 10,
dra_prepare_p99_ms_with_100_health_streams <= 10, device_plugin_timeouts and dra_timeouts 0.

    .venv/bin/python bench/abuse.py [--nodes 5000] [--fat-pods 1000] [--streams 100] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

GPUS = 8
GPU_MEMORY = 80 * 2**30
NS = "bench"
TRACEBACK = "Traceback (most recent call last)"


def loaded_beside_alone(stem: str, loaded_as: str, loaded: Sequence[float], alone: Sequence[float],
                        digits: int = 2) -> dict[str, float]:
    """p99 and p50 (ms) of one call measured under the abuse (keys ``<stem>_pQQ_ms_<loaded_as>``) and alone
    (``<stem>_pQQ_ms_alone``), so every part of this benchmark reports the pair the same way."""
    out = {}
    for label, values in ((loaded_as, loaded), ("alone", alone)):
        for q in (99, 50):
            out[f"{stem}_p{q}_ms_{label}"] = round(float(np.percentile(values, q)), digits)
    return out


# ---- processes ----------------------------------------------------------------------------------

def serve_apiserver(nodes: int, kubeconfig: str) -> None:
    """Child process: the stand-in API server with ``nodes`` GPU nodes, until stdin closes."""
    from kubegpu.model.device_object import device_object
    from kubegpu.model.inventory import Gpu, NodeInventory
    from kubegpu_standins.apiserver import ApiServer

    api = ApiServer(history=20_000)
    for i in range(nodes):
        name = f"node-{i:05d}"
        uuids = [f"GPU-{i:05d}-{j}-abuse-0000-000000000000" for j in range(GPUS)]
        gpus = tuple(Gpu(uuid=u, index=j, minor=j, model="NVIDIA A100-SXM4-80GB", memory_bytes=GPU_MEMORY)
                     for j, u in enumerate(uuids))
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        api.put_object(device_object(NodeInventory(name, gpus, cpu_milli=128_000, memory_bytes=1 << 40)))
    api.put_object({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "eight", "namespace": NS},
                    "spec": {"containers": [{"name": "c", "image": "x",
                                             "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}})
    api.start()
    api.write_kubeconfig(kubeconfig)
    print(json.dumps({"url": api.url}), flush=True)
    sys.stdin.read()
    api.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from kubegpu.cli.main import main; main()", *args]


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[Any], what: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (httpx.TransportError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready")
        time.sleep(0.2)


# ---- HTTP abuse, shared by the extender and the webhook -----------------------------------------
class Tally:
    def __init__(self) -> None:
        self.cases = 0
        self.server_errors = 0
        self.examples: list[str] = []
        self.lock = threading.Lock()

    def add(self, ok: bool, what: str) -> None:
        with self.lock:
            self.cases += 1
            if not ok:
                self.server_errors += 1
                if len(self.examples) < 10:
                    self.examples.append(what[:200])


def raw_exchange(host: str, port: int, data: bytes, tls: ssl.SSLContext | None, *, hang_up: bool = False,
                 wait_s: float = 30.0) -> bytes:
    """Send raw bytes; return what comes back until the server closes (b"" when it closed silently)."""
    sock = socket.create_connection((host, port), timeout=wait_s)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    try:
        sock.sendall(data)
        if hang_up:
            return b""
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return out or b"TIMEOUT"
            except (ConnectionResetError, ssl.SSLError):
                return out
            if not chunk:
                return out
            out += chunk
            if b"\r\n\r\n" in out and _complete(out):
                return out
    finally:
        sock.close()


def _complete(reply: bytes) -> bool:
    head, _, body = reply.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def garbage_bodies(rng: random.Random, wrap: Callable[[Any], Any]) -> list[bytes]:
    """Bodies of every malformed kind; ``wrap`` puts a value where the server expects its object."""
    deep = ["[" * 100_000, "{\"a\":" * 40_000, "[" * 3000 + "]" * 3000]
    values: list[Any] = [None, 1, "x", [], {}, [1, 2], {"metadata": "x"}, {"spec": []},
                         {"spec": {"containers": "x"}}, {"spec": {"containers": [None, 1, "a"]}},
                         {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "-1"}}}]}},
                         {"spec": {"containers": [{"resources": {"limits": {"kubegpu.io/gpu": "1e308"}}}]}},
                         {"metadata": {"annotations": {"kubegpu.io/device-allocated": "[" * 50_000}}}]
    out: list[bytes] = []
    for _ in range(40):
        out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400))))
    for d in deep:
        out.append(d.encode())
        out.append(json.dumps(wrap(None)).replace("null", d, 1).encode())
    for v in values:
        out.append(json.dumps(wrap(v)).encode())
    for _ in range(60):
        out.append(json.dumps(wrap(random_json(rng, 4))).encode())
    return out


def random_json(rng: random.Random, depth: int) -> Any:
    keys = ["metadata", "spec", "containers", "resources", "limits", "nvidia.com/gpu", "kubegpu.io/gpu",
            "name", "uid", "annotations", "env", "initContainers", "Pod", "NodeNames", "x"]
    r = rng.random()
    if depth == 0 or r < 0.3:
        return rng.choice([None, True, 0, -1, 2**63, 1.5, "", "1", "100", "8Gi", "a" * rng.randint(0, 50)])
    if r < 0.6:
        return [random_json(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(keys): random_json(rng, depth - 1) for _ in range(rng.randint(0, 5))}


def http_abuse(tally: Tally, host: str, port: int, paths: list[str], bodies: list[bytes],
               tls: ssl.SSLContext | None, rounds: int) -> None:
    """Every body to every path, ``rounds`` times, over kept-alive connections; then the transport-level
    abuse (oversized, half-sent, abandoned, endless headers) in parallel."""
    scheme = "https" if tls else "http"
    with httpx.Client(base_url=f"{scheme}://{host}:{port}", verify=tls or False, timeout=60) as client:
        for _ in range(rounds):
            for path in paths:
                for body in bodies:
                    try:
                        r = client.post(path, content=body, headers={"content-type": "application/json"})
                        tally.add(r.status_code < 500, f"{path} {r.status_code} {r.text[:100]}")
                    except httpx.HTTPError as e:
                        tally.add(False, f"{path}: {type(e).__name__}: {e}")

    def expect(data: bytes, statuses: tuple[int, ...], hang_up: bool = False) -> None:
        try:
            reply = raw_exchange(host, port, data, tls, hang_up=hang_up)
        except OSError as e:
            tally.add(False, f"transport: {e}")
            return
        tally.add(hang_up or status_of(reply) in statuses or (not reply and 0 in statuses),
                  f"transport {data[:60]!r} -> {reply[:120]!r}")

    path = paths[0].encode()
    jobs: list[tuple[bytes, tuple[int, ...], bool]] = []
    for _ in range(25):
        jobs.append((b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"a\":", (408,), False))
        jobs.append((b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999\r\n\r\n", (413,), False))
        jobs.append((b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n{\"a\":", (), True))
        jobs.append((b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n", (408, 0), False))
        jobs.append((b"GET /healthz HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 40_000 + b"\r\n\r\n", (400, 431, 0), False))
        jobs.append((b"NOT HTTP AT ALL\r\n\r\n", (400, 0), False))
    threads = [threading.Thread(target=expect, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- the extender -------------------------------------------------------------------------------
def pod_body(containers: list[dict[str, str]], uid: str, names: list[str], extra: dict[str, Any] | None = None
             ) -> bytes:
    spec: dict[str, Any] = {"containers": [{"name": f"c{i}", "image": "x", "resources": {"limits": lim}}
                                           for i, lim in enumerate(containers)]}
    if extra:
        spec["containers"][0].update(extra)
    pod = {"metadata": {"name": uid, "namespace": NS, "uid": uid}, "spec": spec}
    return json.dumps({"Pod": pod, "NodeNames": names}).encode()


def extender_bench(tally: Tally, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kubeconfig = work / "kubeconfig"
    api = subprocess.Popen([sys.executable, __file__, "--serve-apiserver", "--nodes", str(args.nodes),
                            "--kubeconfig", str(kubeconfig)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=env)
    log = (work / "extender.log").open("wb")
    ext = None
    try:
        assert api.stdout is not None
        api_base = json.loads(api.stdout.readline())["url"]
        port = free_port()
        ext = subprocess.Popen(cli("scheduler", "--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{port}",
                                   "--log-level", "warning"), env=env, stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(base + "/healthz").status_code == 200, ext, "the extender")
        names = [f"node-{i:05d}" for i in range(args.nodes)]
        few = names[:50]

        def wrap_args(v: Any) -> Any:
            return {"Pod": v, "NodeNames": few}

        bodies = garbage_bodies(rng, wrap_args) + [json.dumps({"Pod": random_json(rng, 3), "NodeNames": random_json(
            rng, 2)}).encode() for _ in range(60)] + [json.dumps(random_json(rng, 3)).encode() for _ in range(20)]
        http_abuse(tally, "127.0.0.1", port, ["/filter", "/prioritize", "/bind", "/scheduler/filter"], bodies, None,
                   rounds=args.rounds)

        http = httpx.Client(base_url=base, timeout=60)
        # A real pod's UID with a smaller request: bind must record the API server's 8 whole GPUs.
        uid = httpx.get(f"{api_base}/api/v1/namespaces/{NS}/pods/eight").json()["metadata"]["uid"]
        forged = json.dumps({"Pod": {"metadata": {"name": "eight", "namespace": NS, "uid": uid}, "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"kubegpu.io/gpu": "10"}}}]}},
            "NodeNames": few}).encode()
        tally.add(http.post("/filter", content=forged).status_code == 200, "forged filter")
        r = http.post("/bind", json={"PodName": "eight", "PodNamespace": NS, "PodUID": uid, "Node": few[0]})
        tally.add(r.status_code == 200, f"bind {r.text[:100]}")
        pod = httpx.get(f"{api_base}/api/v1/namespaces/{NS}/pods/eight").json()
        record = json.loads(pod["metadata"].get("annotations", {}).get("kubegpu.io/device-allocated", "{}"))
        bind_recorded_gpus = len(record.get("gpu", []))

        big = pod_body([{"kubegpu.io/gpu": "1"}] * 1000, "big", names)
        at_cap = pod_body([{"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory-ratio": "10"}] * 32, "cap", names)
        small = pod_body([{"nvidia.com/gpu": "1"}], "small", names)
        big_ms, cap_ms = [], []
        for _ in range(5):
            for body, into in ((big, big_ms), (at_cap, cap_ms)):
                t0 = time.perf_counter()
                r = http.post("/filter", content=body)
                into.append((time.perf_counter() - t0) * 1000)
                tally.add(r.status_code == 200, f"big filter {r.status_code}")
        alone_ms = []
        for _ in range(max(20, args.small_filters // 5)):
            t0 = time.perf_counter()
            r = http.post("/filter", content=small)
            alone_ms.append((time.perf_counter() - t0) * 1000)
            tally.add(r.status_code == 200, f"small filter {r.status_code}")
        # Small filters while large ones are in flight, back to back, on another connection.
        stop = threading.Event()

        def hammer() -> None:
            with httpx.Client(base_url=base, timeout=60) as c:
                while not stop.is_set():
                    for body in (big, at_cap):
                        r = c.post("/filter", content=body)
                        tally.add(r.status_code == 200, f"big filter {r.status_code}")

        bg = threading.Thread(target=hammer)
        bg.start()
        time.sleep(0.5)
        small_ms = []
        for _ in range(args.small_filters):
            t0 = time.perf_counter()
            r = http.post("/filter", content=small)
            small_ms.append((time.perf_counter() - t0) * 1000)
            tally.add(r.status_code == 200 and len(r.json()["NodeNames"] or []) > 0, f"small filter {r.status_code}")
        stop.set()
        bg.join()
        # Fat pods: ~1 MiB each (a long env list), every one a distinct UID.
        env_list = [{"name": f"VAR_{i}", "value": "x" * 200} for i in range(4500)]
        template = pod_body([{"nvidia.com/gpu": "1"}], "UIDUIDUID", few, {"env": env_list})
        head, _, tail = template.partition(b"UIDUIDUID")
        mid, _, tail = tail.partition(b"UIDUIDUID")
        rss_before = rss_mb(ext.pid)
        for k in range(args.fat_pods):
            uid_k = f"fat-{k:06d}".encode()
            r = http.post("/filter", content=head + uid_k + mid + uid_k + tail)
            tally.add(r.status_code == 200, f"fat pod {r.status_code}")
        rss_after = rss_mb(ext.pid)
        return {
            "nodes": args.nodes,
            "big_pod_filter_ms": round(float(np.median(big_ms)), 1),
            "big_pod_at_cap_filter_ms": round(float(np.median(cap_ms)), 1),
            **loaded_beside_alone("small_filter", "during_big", small_ms, alone_ms, digits=1),
            "fat_pod_bytes": len(template),
            "extender_rss_mb_before_fat_pods": round(rss_before, 1),
            "extender_rss_mb_after_1000_fat_pods": round(rss_after, 1),
            "bind_recorded_gpus_for_8_gpu_pod_after_forged_filter": bind_recorded_gpus,
        }
    finally:
        if ext is not None:
            ext.terminate()
            ext.wait(30)
        assert api.stdin is not None
        api.stdin.close()
        api.wait(30)
        log.close()


# ---- the webhook --------------------------------------------------------------------------------
def webhook_bench(tally: Tally, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    from kubegpu.webhook.certs import generate_ca, issue_serving_cert

    rng = random.Random(args.seed + 1)
    ca = generate_ca()
    (work / "ca.crt").write_bytes(ca.cert_pem)
    issue_serving_cert(ca, ["127.0.0.1"]).write(work / "tls.crt", work / "tls.key")
    port = free_port()
    log = (work / "webhook.log").open("wb")
    hook = subprocess.Popen(cli("webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(work / "tls.crt"),
                                "--tls-key", str(work / "tls.key"), "--namespace", "kubegpu-system",
                                "--log-level", "warning"), env=env, stdout=log, stderr=log)
    tls = ssl.create_default_context(cafile=str(work / "ca.crt"))
    try:
        wait_until(lambda: httpx.get(f"https://127.0.0.1:{port}/healthz", verify=tls).status_code == 200, hook,
                   "the webhook", 60)

        def review(obj: Any, op: str = "CREATE", user: str = "alice") -> dict[str, Any]:
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "u", "kind": {"kind": "Pod"}, "namespace": "team", "operation": op, "object": obj,
                "oldObject": obj if op == "UPDATE" else None, "userInfo": {"username": user}}}

        bodies = garbage_bodies(rng, review) + [json.dumps(random_json(rng, 4)).encode() for _ in range(20)]
        forged = {"metadata": {"name": "f", "annotations": {"kubegpu.io/device-allocated": '{"gpu":[]}'}},
                  "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
        wide = {"metadata": {"name": "w"}, "spec": {"containers": [
            {"name": f"c{i}", "resources": {"limits": {"kubegpu.io/gpu": "1"}}} for i in range(1000)]}}
        refused = 0
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=tls, timeout=60) as c:
            for obj in (forged, wide):
                for path in ("/mutate", "/validate"):
                    r = c.post(path, json=review(obj))
                    ok = r.status_code == 200 and r.json()["response"]["allowed"] is False
                    refused += ok
                    tally.add(r.status_code == 200, f"{path} {r.status_code}")
        http_abuse(tally, "127.0.0.1", port, ["/mutate", "/validate"], bodies, tls, rounds=args.rounds)
        return {"webhook_refused_forged_and_wide": refused}
    finally:
        hook.terminate()
        hook.wait(30)
        log.close()


# ---- the device plugin --------------------------------------------------------------------------
def node_bench(tally: Tally, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    import grpc

    from kubegpu.node.proto import deviceplugin_pb2 as pb
    from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc
    from kubegpu_standins.kubelet import StandinKubelet

    gpu = "nvidia.com/gpu"
    kubelet = StandinKubelet(work / "dp")
    kubelet.start()
    log = (work / "node.log").open("wb")
    node = subprocess.Popen(cli("node", "--standalone", "--inventory", "dgx1-v100", "--device-plugin-dir",
                                str(work / "dp"), "--shared-slots", "100", "--cdi-spec-dir", str(work / "cdi"),
                                "--metrics-address", "0", "--log-level", "warning"), env=env, stdout=log, stderr=log)
    bad_codes = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
    streams: list[Any] = []
    try:
        if not kubelet.wait_registered(gpu, 60):
            raise RuntimeError("the node daemon did not register")
        st = kubelet.resources[gpu]
        channel = grpc.insecure_channel(f"unix://{kubelet.dir / st.endpoint}",
                                        options=[("grpc.default_authority", "localhost")])
        stub = pb_grpc.DevicePluginStub(channel)
        ids = sorted(kubelet.healthy(gpu))
        rng = random.Random(args.seed + 2)
        timeouts = 0

        def call(fn: Any, req: Any, what: str) -> None:
            nonlocal timeouts
            try:
                fn(req, timeout=5)
                tally.add(True, what)
            except grpc.RpcError as e:
                code = e.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    timeouts += 1
                detail = e.details() or ""  # type: ignore[attr-defined]
                tally.add(code not in bad_codes and code != grpc.StatusCode.DEADLINE_EXCEEDED
                          and len(detail) < 4096, f"{what}: {code} {detail[:100]}")

        weird_ids = ["", "x" * (1 << 20), "GPU-unknown", "../../etc", "\x00", ids[0] * 1000, "é" * 5000]
        for _ in range(args.rounds):
            for wid in weird_ids:
                call(stub.Allocate, pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                    devices_ids=[wid])]), "Allocate weird id")
                call(stub.GetPreferredAllocation, pb.PreferredAllocationRequest(container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=[wid, *ids], allocation_size=1)]),
                    "GPA weird id")
            for size in (0, -1, 2**31 - 1, -2**31, len(ids) + 1, 10**6):
                call(stub.GetPreferredAllocation, pb.PreferredAllocationRequest(container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=size)]),
                    f"GPA size {size}")
            for _ in range(20):
                n = rng.randint(0, 20)
                req_ids = [rng.choice([*ids, "bogus", ""]) for _ in range(n)]
                call(stub.Allocate, pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                    devices_ids=req_ids)] * rng.randint(0, 3)), "Allocate random")
                call(stub.GetPreferredAllocation, pb.PreferredAllocationRequest(container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=req_ids,
                                                           must_include_deviceIDs=rng.sample(req_ids, min(2, n)),
                                                           allocation_size=rng.randint(-3, 30))]), "GPA random")
        def allocations() -> list[Callable[[], str]]:
            reqs = [pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                devices_ids=rng.sample(ids, rng.randint(1, 2)))]) for _ in range(args.allocations)]
            return [lambda req=req: (stub.Allocate(req, timeout=2), "")[1] for req in reqs]

        alone, _ = timed_calls(tally, allocations(), "Allocate alone")
        rss_alone = rss_mb(node.pid)
        # Extra ListAndWatch streams, never read, as a kubelet reopening them on every restart would leave.
        for _ in range(args.streams):
            streams.append(stub.ListAndWatch(pb.Empty()))
        time.sleep(1.0)
        lat, stream_timeouts = timed_calls(tally, allocations(), "Allocate with streams")
        return {**loaded_beside_alone("allocate", "with_100_streams", lat, alone),
                "device_plugin_timeouts": timeouts + stream_timeouts,
                "node_rss_mb_before_streams": round(rss_alone, 1), "node_rss_mb": round(rss_mb(node.pid), 1)}
    finally:
        for s in streams:
            s.cancel()
        node.terminate()
        node.wait(30)
        kubelet.stop()
        log.close()


# ---- gRPC calls under streams, shared by the device plugin and the DRA driver -------------------
def timed_calls(tally: Tally, calls: list[Callable[[], str]], what: str) -> tuple[list[float], int]:
    """Each call's latency (ms) and how many timed out. A call returns "" when answered, else what it was
    answered wrongly; a gRPC status is wrong when it is a server error or a time-out."""
    import grpc

    bad = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.DEADLINE_EXCEEDED}
    lat: list[float] = []
    timeouts = 0
    for fn in calls:
        if timeouts >= 20 and len(lat) >= 20 and min(lat[-20:]) >= 2000:
            break  # starved: twenty 2-s timeouts in a row say enough
        t0 = time.perf_counter()
        try:
            problem = fn()
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            timeouts += code == grpc.StatusCode.DEADLINE_EXCEEDED
            problem = str(code) if code in bad else ""
        lat.append((time.perf_counter() - t0) * 1000)
        tally.add(not problem, f"{what}: {problem}")
    return lat, timeouts


# ---- the DRA driver -----------------------------------------------------------------------------
def _prepare_request(api: Any, i: int, node: str) -> Any:
    """A whole-GPU ResourceClaim allocated on ``node``, stored in the API server, as the request that prepares it."""
    import uuid

    from kubegpu.node.dra.names import DRIVER
    from kubegpu.node.dra.proto import dra_v1_pb2 as pb

    claim = api.put_object({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"abuse-{i}", "namespace": NS, "uid": str(uuid.uuid4())},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"device": f"gpu-{i % 4}", "driver": DRIVER, "pool": node, "request": "gpu"}]}}}})
    m = claim["metadata"]
    return pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])])


def dra_bench(tally: Tally, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """NodePrepareResources latency while ``--streams`` idle health streams are open on the same connection."""
    import grpc

    from kubegpu.node.dra.names import DRIVER
    from kubegpu.node.dra.proto import dra_health_pb2 as hpb
    from kubegpu.node.dra.proto import dra_health_pb2_grpc, dra_v1_pb2_grpc
    from kubegpu.node.runtime_env import NODE_ENV
    from kubegpu_standins.apiserver import ApiServer
    from kubegpu_standins.dra_kubelet import DraKubelet

    node_name = "abuse-node"
    api = ApiServer().start()
    kubelet = DraKubelet(api, work / "dra-kubelet", node_name)
    kubelet.start()
    log = (work / "dra.log").open("wb")
    dra = subprocess.Popen(cli("node", "--kubelet-plugin", "dra", "--inventory", "dgx-a100", "--dra-shared-gpus", "4-7",
                               "--node-name", node_name, "--kubeconfig", str(api.write_kubeconfig(work / "dra-kc")),
                               "--dra-plugins-dir", str(kubelet.plugins_dir), "--dra-registry-dir",
                               str(kubelet.registry), "--cdi-spec-dir", str(work / "dra-cdi"),
                               "--metrics-address", "127.0.0.1:0", "--log-level", "warning"),
                           env={**env, **NODE_ENV}, stdout=log, stderr=log)
    streams: list[Any] = []
    channel = None
    try:
        if not kubelet.wait(lambda: DRIVER in kubelet.plugins, 60):
            raise RuntimeError("the DRA driver did not register")
        channel = grpc.insecure_channel(f"unix://{kubelet.plugins[DRIVER].endpoint}")
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        health = dra_health_pb2_grpc.DRAResourceHealthStub(channel)
        def prepares(first: int) -> list[Callable[[], str]]:
            reqs = [_prepare_request(api, first + i, node_name) for i in range(args.allocations)]
            return [lambda req=req: next(iter(stub.NodePrepareResources(req, timeout=2).claims.values())).error
                    for req in reqs]

        alone, timeouts = timed_calls(tally, prepares(0), "NodePrepareResources alone")
        rss_alone = rss_mb(dra.pid)
        # Extra health streams, never read, as a kubelet reopening them on every registration would leave.
        for _ in range(args.streams):
            streams.append(health.NodeWatchResources(hpb.NodeWatchResourcesRequest()))
        time.sleep(1.0)
        lat, stream_timeouts = timed_calls(tally, prepares(args.allocations), "NodePrepareResources with streams")
        return {**loaded_beside_alone("dra_prepare", "with_100_health_streams", lat, alone),
                "dra_timeouts": timeouts + stream_timeouts,
                "dra_rss_mb_before_streams": round(rss_alone, 1), "dra_rss_mb": round(rss_mb(dra.pid), 1)}
    finally:
        for s in streams:
            s.cancel()
        if channel is not None:
            channel.close()
        dra.terminate()
        dra.wait(30)
        kubelet.stop()
        api.stop()
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--fat-pods", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="passes over the malformed bodies per server")
    ap.add_argument("--small-filters", type=int, default=300)
    ap.add_argument("--allocations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=["extender", "webhook", "device_plugin", "dra"], help="run one part")
    ap.add_argument("--serve-apiserver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_apiserver:
        serve_apiserver(args.nodes, args.kubeconfig)
        return
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    work = Path(tempfile.mkdtemp(prefix="kgabuse-", dir="/tmp"))
    tallies = {"extender": Tally(), "webhook": Tally(), "device_plugin": Tally(), "dra": Tally()}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, fn in (("webhook", webhook_bench), ("device_plugin", node_bench), ("dra", dra_bench),
                     ("extender", extender_bench)):
        if args.only and name != args.only:
            continue
        t = time.perf_counter()
        out.update(fn(tallies[name], args, work, env))
        print(f"{name}: {tallies[name].cases} cases in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    logs = {name: (work / f"{name}.log").read_text(errors="replace")
            for name in ("extender", "webhook", "node", "dra") if (work / f"{name}.log").exists()}
    result = {
        "cases": sum(t.cases for t in tallies.values()),
        "cases_by_server": {k: t.cases for k, t in tallies.items()},
        "server_errors": sum(t.server_errors for t in tallies.values()),
        "server_errors_by_server": {k: t.server_errors for k, t in tallies.items()},
        "server_error_examples": [e for t in tallies.values() for e in t.examples][:10],
        "tracebacks_logged": sum(text.count(TRACEBACK) for text in logs.values()),
        "tracebacks_by_log": {k: text.count(TRACEBACK) for k, text in logs.items()},
        **out,
        "wall_s": round(time.perf_counter() - t0, 1),
        "logs": str(work),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
