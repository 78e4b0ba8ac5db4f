"""Benchmark of the scheduler extender at cluster scale: filter, prioritize and bind over loopback HTTP.

A stand-in API server (its own process) holds N nodes x 8 GPUs with their Device objects and a
trace-like mix of pods already bound and filling the GPUs to about 70 %, plus the pending pods to
place. Running pods carry the extender's record and, as in a live cluster, the node's acknowledgement
(``kubegpu.io/device-assigned``), except a share ``--unserved`` of them (1 % by default: pods bound a
moment ago whose kubelet handoff is still in flight), which the extender's handoff wait holds against
pods of the same kind on their nodes. The bench's own binds are acknowledged by a thread playing the
node daemons (``--no-ack``: never, so each node then waits on its first bench pod until the wait runs out).
``kubegpu scheduler`` (its own process, as deployed: the learned target workload and the handoff
wait on; ``KUBEGPU_HANDOFF_WAIT`` is dropped from its environment) watches it. This process then plays
kube-scheduler: for each pending pod, sequentially, ``filter`` with every node name, ``prioritize``
with the nodes that passed, ``bind`` to the best one. Prints one JSON object as its last line:
``nodes``, ``filter_p50_ms``, ``filter_p99_ms``, ``prioritize_p99_ms``, ``bind_p99_ms``,
``pods_per_s``, ``rss_mb`` (the extender's resident memory after the run; ``rss_peak_mb`` too), plus
``<verb>_server_mean_ms`` and ``pods_per_s_extender`` measured inside the extender (its latency
histograms), which leave out this harness's own client work, ``extender_cpu_ms_per_pod`` (user +
system CPU of the extender process over the timed loop, per pod: what other work on the machine
changes least), ``extender_cpu_ms_per_pod_by_verb`` (the same CPU split by the call it was spent in: ``filter``,
``prioritize``, ``bind``, and ``other`` between calls, such as watch events; read from the extender's
process CPU clock around each call), ``handoff_blocked_nodes_mean`` (nodes per filter left out by the handoff wait) and
``learned_workload`` (the extender's debug API after the run: live pods, generation, rebuilds
during the run), ``metrics_scrape_ms`` (the slowest of five ``/metrics`` scrapes after the run: the extender's
loop answers nothing else meanwhile) and ``metrics_bytes``. ``--py-spy FILE`` writes a sampling profile of the
extender over the timed loop (``py-spy`` installed in the venv).

Targets (2-core machine): >= 200 pods/s end to end (``pods_per_s``), every verb's p99 <= 10 ms at
5,000 nodes, extender CPU <= 4 ms per pod (``extender_cpu_ms_per_pod``), RSS <= 300 MB. Wall times depend on
what else runs on the machine (``load_avg``); the CPU figures much less.

    .venv/bin/python bench/extender.py [--nodes 5000] [--pods 300] [--fill 0.7] [--unserved 0.01] [--seed 1]
"""

from __future__ import annotations

import argparse
import ctypes
import http.client as http_client
import json
import operator
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

# The client side stands in for kube-scheduler (Go): keep its own JSON work out of the way with msgspec.
encode = msgspec.json.encode
decode = msgspec.json.decode


# gc=False: thousands of these per answer, none in a cycle; untracked they decode about a fifth faster.
class _Passed(msgspec.Struct, gc=False):
    NodeNames: list[str] | None = None


class _Host(msgspec.Struct, gc=False):
    Host: str
    Score: int


decode_filter = msgspec.json.Decoder(_Passed).decode  # only what kube-scheduler reads next
decode_scores = msgspec.json.Decoder(list[_Host]).decode
_score = operator.attrgetter("Score")
GPUS_PER_NODE = 8
GPU_MEMORY = 80 * 2**30
MODEL = "NVIDIA A100-SXM4-80GB"
NAMESPACE = "bench"
# Per-pod GPU shapes and weights, close to the Alibaba openb trace's mix: (kind, GPUs, percent per GPU).
MIX: tuple[tuple[tuple[str, int, int], float], ...] = (
    (("whole", 1, 100), 0.38), (("share", 1, 50), 0.16), (("share", 1, 25), 0.14), (("share", 1, 10), 0.07),
    (("whole", 2, 100), 0.10), (("whole", 4, 100), 0.08), (("whole", 8, 100), 0.04), (("share", 2, 50), 0.03),
)


def draw(rng: random.Random) -> tuple[str, int, int]:
    shapes, weights = zip(*MIX, strict=True)
    return rng.choices(shapes, weights)[0]


def limits(shape: tuple[str, int, int]) -> dict[str, str]:
    kind, n, pct = shape
    if kind == "whole":
        return {"nvidia.com/gpu": str(n)}
    return {"kubegpu.io/gpu-core": str(pct * n), "kubegpu.io/gpu-memory-ratio": str(pct * n),
            "kubegpu.io/gpu.shared": str(n)}


def pod_object(name: str, shape: tuple[str, int, int], node: str = "", annotation: str = "",
               uid: str = "", ack: str = "") -> dict[str, Any]:
    lim = limits(shape)
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "bench"}},
        "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {"limits": lim, "requests": lim}}],
                 "schedulerName": "default-scheduler"},
        "status": {"phase": "Running" if node else "Pending"},
    }
    if uid:
        pod["metadata"]["uid"] = uid
    if node:
        pod["spec"]["nodeName"] = node
    if annotation:
        pod["metadata"]["annotations"] = {"kubegpu.io/device-allocated": annotation}
        if ack:
            pod["metadata"]["annotations"]["kubegpu.io/device-assigned"] = ack
    return pod


def fill_node(rng: random.Random, node: str, uuids: list[str], target: float,
              unserved: float = 0.0) -> list[dict[str, Any]]:
    """Pods already running on one node, first-fit on its GPUs, until about ``target`` of its compute is used;
    each served by the node (acknowledged) except a share ``unserved`` of them."""
    from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
    from kubegpu.model.records import Ack, encode_acks

    free = [100] * len(uuids)
    pods = []
    misses = 0
    while sum(100 - f for f in free) < target * 100 * len(uuids) and misses < 12:
        shape = draw(rng)
        kind, n, pct = shape
        need = 100 if kind == "whole" else pct
        room = [j for j, f in enumerate(free) if f >= need and (kind == "share" or f == 100)]
        if len(room) < n:
            misses += 1
            continue
        chosen = room[:n] if kind == "whole" else sorted(room, key=lambda j: (free[j], j))[:n]
        grants = []
        for j in chosen:
            free[j] -= need
            grants.append(DeviceGrant(j, uuids[j], need, GPU_MEMORY * need // 100, need))
        value = encode(PodAllocation((ContainerAllocation("main", tuple(grants)),)))
        ack = ""
        if rng.random() >= unserved:
            resource = "nvidia.com/gpu" if kind == "whole" else "kubegpu.io/gpu.shared"
            devices = tuple(g.uuid if kind == "whole" else f"{g.uuid}::{len(pods)}" for g in grants)
            ack = encode_acks({"main": Ack(resource, devices, tuple(grants))})
        pods.append(pod_object(f"run-{node}-{len(pods)}", shape, node, value, ack=ack))
    return pods


def serve_apiserver(nodes: int, pending: int, fill: float, seed: int, kubeconfig: str, unserved: float) -> None:
    """Child process: seed the stand-in API server with the cluster and serve it until stdin closes."""
    from kubegpu.model.device_object import device_object
    from kubegpu.model.inventory import Gpu, NodeInventory
    from kubegpu_standins.apiserver import ApiServer

    rng = random.Random(seed)
    api = ApiServer(history=50_000)
    running = unacked = 0
    for i in range(nodes):
        name = f"node-{i:05d}"
        uuids = [f"GPU-{i:05d}-{j}-bench-0000-000000000000" for j in range(GPUS_PER_NODE)]
        gpus = tuple(Gpu(uuid=u, index=j, minor=j, model=MODEL, memory_bytes=GPU_MEMORY,
                         links={v: 12 for v in uuids if v != u}) for j, u in enumerate(uuids))
        inv = NodeInventory(name, gpus, cpu_milli=128_000, memory_bytes=1 << 40)
        api.put_object({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}},
                        "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}}})
        api.put_object(device_object(inv))
        target = min(1.0, max(0.0, rng.gauss(fill, 0.2)))
        for p in fill_node(rng, name, uuids, target, unserved):
            api.put_object(p)
            running += 1
            unacked += "kubegpu.io/device-assigned" not in p["metadata"]["annotations"]
    for k in range(pending):
        api.put_object(pod_object(f"pending-{k:05d}", draw(rng)))
    api.start()
    api.write_kubeconfig(kubeconfig)
    print(json.dumps({"url": api.url, "running": running, "unserved": unacked}), flush=True)
    sys.stdin.read()  # until the parent closes the pipe
    api.stop()


def acknowledge(api_url: str) -> None:
    """Child process: play each bound pod's node daemon, as a live node does once its kubelet has been handed
    the pod: write the acknowledgement (``kubegpu.io/device-assigned``) of the GPUs the extender recorded, so
    the handoff wait of the next pod of that kind on that node ends. Reads one bound pod's name per line of
    stdin until it closes, then prints how many it acknowledged. Its own process, and http.client over one
    kept connection: the node daemons run on their own nodes, so their work must not take this harness's
    interpreter lock (nor its time) while it plays kube-scheduler."""
    from kubegpu.model.allocation import decode as decode_alloc
    from kubegpu.model.records import encode_acks
    from kubegpu_standins.production_replay import served_acks

    url = httpx.URL(api_url)
    conn = http_client.HTTPConnection(url.host, url.port, timeout=60)
    base = f"/api/v1/namespaces/{NAMESPACE}/pods"

    def call(method: str, path: str, body: bytes | None = None) -> bytes:
        conn.request(method, path, body, {"Content-Type": "application/merge-patch+json"} if body else {})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {data[:200]!r}")
        return data

    acked = 0
    for line in sys.stdin:
        name = line.strip()
        ann = decode(call("GET", f"{base}/{name}"))["metadata"].get("annotations") or {}
        acks = served_acks(decode_alloc(ann["kubegpu.io/device-allocated"]), name)
        call("PATCH", f"{base}/{name}",
             encode({"metadata": {"annotations": {"kubegpu.io/device-assigned": encode_acks(acks)}}}))
        acked += 1
    print(acked, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    kb = lambda k: float(fields.get(k, "0 kB").split()[0])  # noqa: E731
    return kb("VmRSS") / 1024, kb("VmHWM") / 1024


def cpu_s(pid: int) -> np.ndarray:
    """(user, system) CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return np.array([int(fields[11]), int(fields[12])], np.float64) / os.sysconf("SC_CLK_TCK")


def cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time (all its threads, nanosecond resolution), for
    :func:`time.clock_gettime`: reading it around each call charges the extender's CPU to one verb."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock = ctypes.c_int()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(ctypes.get_errno(), f"clock_getcpuclockid({pid})")
    return clock.value


def server_means(metrics: str) -> dict[str, float]:
    """Mean time inside the extender's handlers per verb (from its latency histogram)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            prefix = f"kubegpu_extender_request_seconds{suffix}{{verb=\""
            if line.startswith(prefix):
                verb = line[len(prefix):].split('"', 1)[0]
                into[verb] = float(line.rsplit(" ", 1)[1])
    return {v: round(1000 * sums[v] / counts[v], 3) for v in sums if counts.get(v)}


def rejections(metrics: str, reason: str) -> float:
    """Nodes the extender's filter has rejected for ``reason`` so far (its counter)."""
    prefix = f'kubegpu_node_rejections_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 3) if values else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    python = sys.executable
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    env.pop("KUBEGPU_HANDOFF_WAIT", None)  # the extender as deployed: pods of one kind wait their turn per node
    work = Path(tempfile.mkdtemp(prefix="kgbench-"))
    kubeconfig = work / "kubeconfig"
    t0 = time.perf_counter()
    api = subprocess.Popen([python, __file__, "--serve-apiserver", "--nodes", str(args.nodes), "--pods",
                            str(args.pods), "--fill", str(args.fill), "--seed", str(args.seed),
                            "--unserved", str(args.unserved), "--kubeconfig", str(kubeconfig)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ext = acker = None
    try:
        assert api.stdout is not None
        info = json.loads(api.stdout.readline())
        seeded_s = time.perf_counter() - t0
        port = free_port()
        ext = subprocess.Popen([python, "-c", "from kubegpu.cli.main import app; app()", "scheduler",
                                "--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{port}",
                                "--log-level", "warning"], env=env)
        base = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=base, timeout=60)
        deadline = time.monotonic() + 600
        while True:
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or ext.poll() is not None:
                raise RuntimeError("the extender did not become ready")
            time.sleep(0.2)
        synced_s = time.perf_counter() - t0 - seeded_s
        workload_url = "/apis/v1/plugins/DeviceShare/workload"
        learned_before = http.get(workload_url).json()
        blocked_before = rejections(http.get("/metrics").text, "handoff-pending")
        spy = None
        if args.py_spy:  # a sampling profile of the extender during the timed loop only
            spy = subprocess.Popen([str(Path(python).parent / "py-spy"), "record", "--pid", str(ext.pid), "--rate",
                                    "500", "--format", "raw", "--output", args.py_spy, "--nonblocking", "--gil"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        names = [f"node-{i:05d}" for i in range(args.nodes)]
        pending = httpx.get(f"{info['url']}/api/v1/namespaces/{NAMESPACE}/pods",
                            params={"fieldSelector": "spec.nodeName="}, timeout=120).json()["items"]
        pending.sort(key=lambda p: p["metadata"]["name"])
        conn = http_client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def post(path: str, body: bytes) -> bytes:
            # http.client rather than httpx: the caller stands in for kube-scheduler's Go client, whose own
            # cost per call is negligible; keep ours small so the figures are the extender's.
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:200]!r}")
            return data

        lat: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}
        # The extender's CPU per verb: its process CPU clock read around each call; what it spends between
        # calls (watch events, timers) is "other".
        clock = cpu_clock(ext.pid)
        verb_cpu = dict.fromkeys(("filter", "prioritize", "bind", "other"), 0.0)
        mark = time.clock_gettime(clock)

        def charge(verb: str) -> None:
            nonlocal mark
            now = time.clock_gettime(clock)
            verb_cpu[verb] += now - mark
            mark = now

        placed = unschedulable = bind_errors = 0
        # The node daemons' acknowledgements come from a child process fed one bound pod's name per line.
        acker = subprocess.Popen([python, __file__, "--acknowledge", info["url"]], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env) if args.ack else None
        fit_nodes: list[int] = []
        cpu_before = cpu_s(ext.pid), cpu_s(api.pid)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        for k, pod in enumerate(pending):
            offset = (k * 997) % len(names)  # kube-scheduler starts each cycle at a rotating node
            order = names[offset:] + names[:offset]
            body = encode({"Pod": pod, "Nodes": None, "NodeNames": order})
            charge("other")
            t = time.perf_counter()
            data = post("/filter", body)
            lat["filter"].append(time.perf_counter() - t)
            charge("filter")
            passed = decode_filter(data).NodeNames or []
            fit_nodes.append(len(passed))
            if not passed:
                unschedulable += 1
                continue
            best = passed[0]
            if len(passed) > 1:
                body = encode({"Pod": pod, "Nodes": None, "NodeNames": passed})
                charge("other")
                t = time.perf_counter()
                data = post("/prioritize", body)
                lat["prioritize"].append(time.perf_counter() - t)
                charge("prioritize")
                scores = decode_scores(data)
                best = max(scores, key=_score).Host
            meta = pod["metadata"]
            body = encode({"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                           "Node": best})
            charge("other")
            t = time.perf_counter()
            data = post("/bind", body)
            lat["bind"].append(time.perf_counter() - t)
            charge("bind")
            if decode(data).get("Error"):
                bind_errors += 1
            else:
                placed += 1
                if acker is not None:
                    assert acker.stdin is not None
                    acker.stdin.write(meta["name"] + "\n")
                    acker.stdin.flush()
        elapsed = time.perf_counter() - start
        acknowledged = None
        if acker is not None:
            acknowledged, _ = acker.communicate(timeout=60)
        charge("other")
        cpu_ext, cpu_api = cpu_s(ext.pid) - cpu_before[0], cpu_s(api.pid) - cpu_before[1]
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        rss, peak = rss_mb(ext.pid)
        scrapes = []
        for _ in range(5):  # what a Prometheus scrape costs: the extender answers nothing else meanwhile
            t0 = time.perf_counter()
            scraped = http.get("/metrics").content
            scrapes.append(time.perf_counter() - t0)
        metrics = scraped.decode()
        server = server_means(metrics)
        learned = http.get(workload_url).json()
        filters = max(1, len(lat["filter"]))
        return {
            "nodes": args.nodes,
            "gpus": args.nodes * GPUS_PER_NODE,
            "running_pods": info["running"],
            "unserved_running_pods": info["unserved"],
            "pods": len(pending),
            "placed": placed,
            "unschedulable": unschedulable,
            "bind_errors": bind_errors,
            "filter_feasible_nodes_mean": round(float(np.mean(fit_nodes)), 1) if fit_nodes else 0,
            "handoff_wait": True,
            "binds_acknowledged": int(acknowledged) if acknowledged else 0,
            "handoff_blocked_nodes_mean": round((rejections(metrics, "handoff-pending") - blocked_before) / filters, 1),
            "learned_workload": {"live_pods": learned["live_pods"], "generation": learned["generation"],
                                 "shapes": len(learned["shapes"]),
                                 "rebuilds_during_run": learned["generation"] - learned_before["generation"]},
            "filter_p50_ms": pct(lat["filter"], 50),
            "filter_p99_ms": pct(lat["filter"], 99),
            "filter_max_ms": pct(lat["filter"], 100),
            "prioritize_p50_ms": pct(lat["prioritize"], 50),
            "prioritize_p99_ms": pct(lat["prioritize"], 99),
            "prioritize_max_ms": pct(lat["prioritize"], 100),
            "bind_p50_ms": pct(lat["bind"], 50),
            "bind_p99_ms": pct(lat["bind"], 99),
            "bind_max_ms": pct(lat["bind"], 100),
            "pods_per_s": round(len(pending) / elapsed, 1),
            # What this harness spent per pod outside the three calls (building and reading bodies).
            "harness_ms_per_pod": round(1000 * (elapsed - sum(map(sum, lat.values()))) / len(pending), 3),
            **{f"{verb}_server_mean_ms": ms for verb, ms in server.items()},
            # The same three verbs counted inside the extender only (without this harness's own HTTP and JSON).
            "pods_per_s_extender": round(1000 / sum(server.values()), 1) if len(server) == 3 else 0.0,
            # CPU the extender (and the stand-in API server) used per pod: what the 2 cores were busy with,
            # whatever else was running.
            "extender_cpu_ms_per_pod": round(1000 * float(cpu_ext.sum()) / len(pending), 3),
            "extender_cpu_ms_per_pod_by_verb": {v: round(1000 * c / len(pending), 3) for v, c in verb_cpu.items()},
            "extender_sys_ms_per_pod": round(1000 * float(cpu_ext[1]) / len(pending), 3),
            "apiserver_cpu_ms_per_pod": round(1000 * float(cpu_api.sum()) / len(pending), 3),
            "rss_mb": round(rss, 1),
            "rss_peak_mb": round(peak, 1),
            "metrics_scrape_ms": pct(scrapes, 100),
            "metrics_bytes": len(scraped),
            # The machine's 1-minute load average before and after the timed loop (other work skews wall times).
            "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "seed_s": round(seeded_s, 1),
            "sync_s": round(synced_s, 1),
        }
    finally:
        if acker is not None and acker.poll() is None:
            acker.kill()
        if ext is not None:
            ext.terminate()
            try:
                ext.wait(10)
            except subprocess.TimeoutExpired:
                ext.kill()
        if api.stdin:
            api.stdin.close()
        try:
            api.wait(10)
        except subprocess.TimeoutExpired:
            api.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=300, help="pending pods to place")
    parser.add_argument("--fill", type=float, default=0.7, help="average share of GPU compute already used")
    parser.add_argument("--unserved", type=float, default=0.01,
                        help="share of running pods still being handed to their kubelet (not acknowledged)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-ack", dest="ack", action="store_false",
                        help="never acknowledge the bench's own binds (each node then waits on its first one)")
    parser.add_argument("--py-spy", default="", help="write a py-spy raw profile of the extender's timed loop here")
    parser.add_argument("--serve-apiserver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--acknowledge", default="", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.acknowledge:
        acknowledge(args.acknowledge)
        return
    if args.serve_apiserver:
        serve_apiserver(args.nodes, args.pods, args.fill, args.seed, args.kubeconfig, args.unserved)
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
