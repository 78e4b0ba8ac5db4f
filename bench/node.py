"""Node daemon benchmark: device-plugin RPC latency, health propagation, re-registration, memory.

``kubegpu node --standalone`` runs as its own process on the 8-GPU DGX-1 topology with
``kubegpu.io/gpu.shared`` at 100 slots per GPU, registered with the in-process stand-in
kubelet over real unix sockets. Measured from the kubelet side:

- ``allocate_p99_ms``: Allocate round trips (1-2 whole GPUs, and 1-2 slots);
- ``preferred_p99_ms``: GetPreferredAllocation for whole GPUs (random free sets, sizes 1/2/4);
- ``preferred_p99_ms_slots``: the same over the 800 slot IDs (sizes 1-4, some slots in use);
- ``reregister_ms``: kubelet.sock re-created (kubelet restart) -> Register received (median of
  the restarts; ``reregister_max_ms`` is the worst);
- ``rss_registered_mb``: the daemon's resident memory once both resources are registered;
  ``rss_mb``: after the load (every series, the restarts). The daemon runs as the DaemonSet runs
  it: the ``kubegpu`` entry point with ``kubegpu.node.runtime_env.NODE_ENV`` in its environment.

``--node-pods N`` (with ``--cluster``): N running pods bound to the node before the daemon starts, shaped
as the API server returns a workload's pod (labels, owner, managed fields, two containers with probes, env
and mounts, status): the handoff watch sees every pod on its node, GPU or not (a node runs up to 110).

``health_propagation_ms`` (injected Xid -> Unhealthy seen on the ListAndWatch stream) needs
the fake backend's injection call, so it runs an in-process daemon on the same topology.
``--nvml``: the daemon finds the node's GPUs through NVML (no ``--inventory``), as on a real GPU node; GPU
sets are then sized to the GPUs found, and the health series (which needs the fake backend) is left out.
``--share-enforcement strict`` (or ``mps``) measures instead one-slot share ``Allocate`` (the scheduler's record
25 % / 4 GiB) on in-process daemons without enforcement and with it (the stand-in MPS control, the fake
driver's compute modes), once each GPU's daemon is up: ``share_allocate_p99_ms`` per mode and
``share_allocate_p99_over_unenforced_ms`` (target: within 20 ms).
The last line is one JSON object. Targets: allocate p99 <= 1 ms, preferred p99 <= 5 ms
(slots <= 20 ms), health <= 1000 ms, re-register <= 1000 ms, RSS <= 60 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procmem import memory_mb

from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc
from kubegpu.node.runtime_env import NODE_ENV
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"
SLOTS = "kubegpu.io/gpu.shared"
TOPOLOGY = "dgx1-v100"
NODE = "node-bench"


def node_pod(i: int, node: str) -> dict[str, Any]:
    """A running, non-GPU workload pod on ``node`` as the API server returns it (about 7 KB of JSON)."""
    name, uid = f"web-7d9f8c6b5-{i:05d}", f"5f0c1d2e-0000-4000-8000-{i:012d}"
    labels = {"app.kubernetes.io/name": "web", "app.kubernetes.io/instance": "web-prod",
              "pod-template-hash": "7d9f8c6b5", "tier": "frontend"}
    fields = {"f:metadata": {"f:labels": {f"f:{k}": {} for k in labels}, "f:ownerReferences": {}},
              "f:spec": {"f:containers": {'k:{"name":"web"}': {".": {}, "f:env": {}, "f:image": {},
                                                                  "f:ports": {}, "f:resources": {}}}}}

    def container(cname: str, port: int) -> dict[str, Any]:
        probe = {"httpGet": {"path": "/healthz", "port": port, "scheme": "HTTP"}, "initialDelaySeconds": 5,
                 "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3}
        return {"name": cname, "image": f"registry.example.com/team/{cname}:1.27.3",
                "args": ["--listen", f":{port}", "--log-format", "json"],
                "ports": [{"containerPort": port, "name": "http", "protocol": "TCP"}],
                "env": [{"name": f"SETTING_{k}", "value": f"value-{k}-{i}"} for k in range(8)]
                + [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}],
                "resources": {"limits": {"cpu": "500m", "memory": "512Mi"},
                              "requests": {"cpu": "100m", "memory": "128Mi"}},
                "volumeMounts": [{"name": "config", "mountPath": "/etc/web", "readOnly": True},
                                 {"name": "kube-api-access-x7k2p", "readOnly": True,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "livenessProbe": probe, "readinessProbe": probe, "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
                "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]}}}

    def status(cname: str) -> dict[str, Any]:
        return {"name": cname, "ready": True, "restartCount": 0, "started": True,
                "image": f"registry.example.com/team/{cname}:1.27.3",
                "imageID": f"registry.example.com/team/{cname}@sha256:{'ab' * 32}",
                "containerID": f"containerd://{'%064x' % (i * 7919 + len(cname))}",
                "state": {"running": {"startedAt": "2026-11-20T08:00:05Z"}}, "lastState": {}}

    conditions = [{"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": "2026-11-20T08:00:06Z"}
                  for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "generateName": "web-7d9f8c6b5-", "namespace": "prod", "uid": uid,
                     "creationTimestamp": "2026-11-20T08:00:00Z", "labels": labels,
                     "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-20T07:59:00Z",
                                     "prometheus.io/scrape": "true"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8c6b5",
                                          "uid": "0e1f2a3b-0000-4000-8000-000000000001", "controller": True,
                                          "blockOwnerDeletion": True}],
                     "managedFields": [{"manager": m, "operation": "Update", "apiVersion": "v1",
                                        "time": "2026-11-20T08:00:06Z", "fieldsType": "FieldsV1", "fieldsV1": fields}
                                       for m in ("kube-controller-manager", "kubelet")]},
        "spec": {"containers": [container("web", 8080), container("sidecar", 9090)],
                 "volumes": [{"name": "config", "configMap": {"name": "web-config", "defaultMode": 420}},
                             {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                                 {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                                 {"configMap": {"name": "kube-root-ca.crt",
                                                "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                                 {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                                     "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
                 "nodeName": node, "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
                 "serviceAccountName": "web", "serviceAccount": "web", "schedulerName": "default-scheduler",
                 "terminationGracePeriodSeconds": 30, "enableServiceLinks": True, "priority": 0,
                 "preemptionPolicy": "PreemptLowerPriority",
                 "tolerations": [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
                                  "tolerationSeconds": 300} for t in ("not-ready", "unreachable")]},
        "status": {"phase": "Running", "conditions": conditions, "hostIP": "10.0.0.12",
                   "podIP": f"10.244.1.{i % 250}", "podIPs": [{"ip": f"10.244.1.{i % 250}"}],
                   "startTime": "2026-11-20T08:00:00Z", "qosClass": "Burstable",
                   "containerStatuses": [status("web"), status("sidecar")]},
    }


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, round(q * (len(s) - 1)))], 3)


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def rpc_latencies(kubelet: StandinKubelet, n: int, rng: random.Random, allocate: bool = True) -> dict[str, list[float]]:
    """Client-side round trips; every request is built before the clock starts."""
    gpu_ids = sorted(kubelet.healthy(GPU))
    slot_ids = sorted(kubelet.healthy(SLOTS))
    stub_gpu = pb_grpc.DevicePluginStub(kubelet.resources[GPU].channel)
    stub_slots = pb_grpc.DevicePluginStub(kubelet.resources[SLOTS].channel)
    by_gpu: dict[str, list[str]] = {}
    for i in slot_ids:
        by_gpu.setdefault(i.split("::")[0], []).append(i)

    sizes = [k for k in (1, 2, 4) if k <= len(gpu_ids)]

    def pref_gpu() -> pb.PreferredAllocationRequest:
        size = rng.choice(sizes)
        avail = rng.sample(gpu_ids, rng.randint(size, len(gpu_ids)))
        return pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=avail, allocation_size=size)])

    def pref_slots() -> pb.PreferredAllocationRequest:
        avail = [i for i in slot_ids if rng.random() > 0.3]  # about 30 % of the slots in use
        rng.shuffle(avail)
        return pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=avail, allocation_size=rng.randint(1, 4))])

    def alloc() -> tuple[Any, pb.AllocateRequest]:
        if rng.random() < 0.5:
            ids, stub = rng.sample(gpu_ids, rng.randint(1, min(2, len(gpu_ids)))), stub_gpu
        else:
            ids = [rng.choice(by_gpu[g]) for g in rng.sample(sorted(by_gpu), rng.randint(1, min(2, len(by_gpu))))]
            stub = stub_slots
        return stub, pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])

    def run(calls: list[tuple[Any, Any]]) -> list[float]:
        # The client's own garbage collection is not the daemon's latency: keep it out of the clock.
        gc.collect()
        gc.disable()
        try:
            out = []
            for method, req in calls:
                t0 = time.perf_counter()
                method(req, timeout=5)
                out.append((time.perf_counter() - t0) * 1000)
            return out
        finally:
            gc.enable()

    def series(k: int) -> dict[str, list[float]]:
        allocs = [alloc() for _ in range(k)]
        return {
            "preferred": run([(stub_gpu.GetPreferredAllocation, pref_gpu()) for _ in range(k)]),
            "preferred_slots": run([(stub_slots.GetPreferredAllocation, pref_slots()) for _ in range(k)]),
            "allocate": run([(stub.Allocate, req) for stub, req in allocs]) if allocate else [],
        }

    series(30)  # warm up connections and code paths
    return series(n)


def reregister(kubelet: StandinKubelet, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        before = kubelet.register_count(GPU)
        kubelet.restart()
        start = kubelet.started_at
        assert start is not None
        if not kubelet.wait_for(lambda b=before: kubelet.register_count(GPU) > b, 10):
            raise RuntimeError("the daemon did not register again within 10 s")
        reg = [c for c in kubelet.calls if c.rpc.endswith("/Register") and c.resource == GPU and c.error is None]
        out.append((reg[-1].t - start) * 1000)
        kubelet.wait_registered(SLOTS, 10, count=kubelet.resources[SLOTS].registrations)
        time.sleep(0.2)
    return out


def health_propagation(rounds: int) -> list[float]:
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.options import load_node_options

    tmp = Path(tempfile.mkdtemp(prefix="kgb-", dir="/tmp"))
    kubelet = StandinKubelet(tmp / "dp")
    kubelet.start()
    backend = FakeBackend(TOPOLOGY)
    options = load_node_options({"shared-slots": "100", "health-recovery-interval": "200ms"}, {},
                                plugin_dir=str(tmp / "dp"), settings={"cdi_dir": str(tmp / "cdi")})
    daemon = NodeDaemon(backend, lambda: options)
    daemon.start()
    out = []
    try:
        if not kubelet.wait_registered(SLOTS, 10):
            raise RuntimeError("in-process daemon did not register")
        uuids = [g.uuid for g in daemon.inventory.gpus]
        for r in range(rounds):
            i = r % 8
            kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 8, 10)
            t0 = time.monotonic()
            backend.inject_xid(i, 48)
            if not kubelet.wait_for(lambda u=uuids[i]: u in kubelet.unhealthy(GPU), 5):
                raise RuntimeError("Xid not propagated within 5 s")
            seen = next(c.t for c in reversed(kubelet.calls)
                        if c.event == "send" and c.resource == GPU
                        and any(d["ID"] == uuids[i] and d["health"] == "Unhealthy" for d in c.response["devices"]))
            out.append((seen - t0) * 1000)
    finally:
        daemon.stop()
        backend.close()
        kubelet.stop()
    return out


class RecordedShare:
    """The scheduler's record for whatever slots the kubelet picked: 25 % / 4 GiB on each slot's GPU (one shape,
    so a strict GPU's lock never refuses the series)."""

    def resolve(self, resource: str, device_ids: Any) -> Any:
        from kubegpu.model.allocation import DeviceGrant
        from kubegpu.node.deviceplugin.resolver import ResolvedAllocation

        if resource != SLOTS:
            return None
        grants = tuple(DeviceGrant(0, i.split("::")[0], 25, 4 * 2**30, 0) for i in device_ids)
        return ResolvedAllocation(grants, pod="bench/share", container="c")

    def preferred(self, resource: str, available: Any, must_include: Any, size: int) -> Any:
        return None

    def set_inventory(self, inventory: Any) -> None:
        pass

    def kubelet_registered(self, resource: str) -> None:
        pass


def share_allocate(enforcement: str, n: int, rng: random.Random) -> list[float]:
    """One-slot share Allocate round trips on an in-process daemon whose shares are enforced by ``enforcement``
    (``none``, ``mps``, ``strict``: the stand-in MPS control and the fake driver's compute modes). Every GPU's
    daemon is brought up first (one Allocate per GPU, not timed): the series is the steady state. The strict
    holders' reconciliation (a PodResources read on the lifecycle thread, not in Allocate) is off."""
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.options import load_node_options
    from kubegpu_standins.fake_driver import ENV_DRIVER_STATE
    from kubegpu_standins.mps_control import PID_FILE, install

    tmp = Path(tempfile.mkdtemp(prefix="kgb-", dir="/tmp"))  # unix socket paths stay short
    kubelet = StandinKubelet(tmp / "dp")
    kubelet.start()
    state, mps = tmp / "driver", tmp / "mps"
    mps.mkdir()
    backend = FakeBackend(TOPOLOGY, driver_state=state)
    flags: dict[str, Any] = {"shared-slots": "100"}
    if enforcement != "none":
        flags |= {"share-enforcement": enforcement, "mps-control-binary": install(mps), "mps-root": str(mps)}
    options = load_node_options(flags, {}, plugin_dir=str(tmp / "dp"), settings={"cdi_dir": str(tmp / "cdi")},
                                holders_s=1e9)
    daemon = NodeDaemon(backend, lambda: options, resolver=RecordedShare(),
                        env={**os.environ, ENV_DRIVER_STATE: str(state)})
    daemon.start()
    try:
        if not kubelet.wait_registered(SLOTS, 10):
            raise RuntimeError("in-process daemon did not register")
        by_gpu: dict[str, list[str]] = {}
        for i in sorted(kubelet.healthy(SLOTS)):
            by_gpu.setdefault(i.split("::")[0], []).append(i)
        stub = pb_grpc.DevicePluginStub(kubelet.resources[SLOTS].channel)

        def req(gpu: str) -> pb.AllocateRequest:
            return pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[rng.choice(by_gpu[gpu])])])

        for gpu in sorted(by_gpu):  # each GPU's daemon up (strict: its server started, the GPU exclusive)
            stub.Allocate(req(gpu), timeout=30)
        calls = [req(rng.choice(sorted(by_gpu))) for _ in range(n + 30)]
        for r in calls[:30]:  # warm up code paths
            stub.Allocate(r, timeout=5)
        gc.collect()
        gc.disable()  # the client's own garbage collection is not the daemon's latency
        try:
            out = []
            for r in calls[30:]:
                t0 = time.perf_counter()
                stub.Allocate(r, timeout=5)
                out.append((time.perf_counter() - t0) * 1000)
            return out
        finally:
            gc.enable()
    finally:
        daemon.stop()  # strict keeps the servers of GPUs whose shares "still run" (here: none will): end them
        for pid_file in mps.rglob(PID_FILE):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
        backend.close()
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def share_enforcement_series(mode: str, n: int, rng: random.Random) -> dict[str, Any]:
    """``--share-enforcement``: share Allocate p50/p99 with ``mode`` beside the unenforced path."""
    plain, enforced = share_allocate("none", n, rng), share_allocate(mode, n, rng)
    return {
        "mode": f"share-allocate-{mode}",
        "share_allocate_p50_ms": {"none": p(plain, 0.5), mode: p(enforced, 0.5)},
        "share_allocate_p99_ms": {"none": p(plain, 0.99), mode: p(enforced, 0.99)},
        "share_allocate_p99_over_unenforced_ms": round((p(enforced, 0.99) or 0) - (p(plain, 0.99) or 0), 3),
        "n": n,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "targets": {"share_allocate_p99_over_unenforced_ms": 20},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1000, help="RPCs per latency series")
    ap.add_argument("--restarts", type=int, default=10)
    ap.add_argument("--health-rounds", type=int, default=16)
    ap.add_argument("--nvml", action="store_true", help="find the node's real GPUs through NVML (a GPU node)")
    ap.add_argument("--cluster", action="store_true",
                    help="run the daemon as the default DaemonSet does, against a (stand-in) API server: node labels "
                         "published and the handoff resolver watching the node's pods, instead of --standalone")
    ap.add_argument("--node-pods", type=int, default=0,
                    help="with --cluster: running non-GPU pods bound to the node before the daemon starts")
    ap.add_argument("--share-enforcement", choices=["mps", "strict"], default=None,
                    help="instead of the series above: one-slot share Allocate latency with this enforcement "
                         "(stand-in MPS control) beside the unenforced path, once each GPU's daemon is up")
    ns = ap.parse_args()
    rng = random.Random(7)
    if ns.share_enforcement:
        print(json.dumps(share_enforcement_series(ns.share_enforcement, ns.n, rng)))
        return

    tmp = Path(tempfile.mkdtemp(prefix="kgb-", dir="/tmp"))
    kubelet = StandinKubelet(tmp / "dp")
    kubelet.start()
    api = ApiServer().start() if ns.cluster else None
    if api is not None:
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for i in range(ns.node_pods):
            api.put_object(node_pod(i, NODE))
        mode = ["--node-name", NODE, "--kubeconfig", str(api.write_kubeconfig(tmp / "kubeconfig"))]
    else:
        mode = ["--standalone"]
    log = (tmp / "node.log").open("wb")
    # As the DaemonSet runs it: the kubegpu entry point, metrics served, NODE_ENV in the environment.
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kubegpu.cli.main import main; main()", "node", *mode,
         *([] if ns.nvml else ["--inventory", TOPOLOGY]), "--device-plugin-dir", str(tmp / "dp"),
         "--shared-slots", "100",
         "--cdi-spec-dir", str(tmp / "cdi"), "--metrics-address", "127.0.0.1:0", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **NODE_ENV})
    result: dict[str, Any] = {}
    try:
        if not (kubelet.wait_registered(GPU, 30) and kubelet.wait_registered(SLOTS, 30)):
            raise RuntimeError("daemon did not register: " + (tmp / "node.log").read_text()[-2000:])
        time.sleep(0.5)  # the registration's own work (the kubelet's first ListAndWatch) has settled
        mem_registered = memory_mb(proc.pid)
        # With an API server, Allocate serves the pods bound to the node as their records say (none here):
        # that series is the standalone daemon's; the cluster mode measures what the default DaemonSet holds.
        lat = rpc_latencies(kubelet, ns.n, rng, allocate=not ns.cluster)
        rr = reregister(kubelet, ns.restarts)
        lat2 = rpc_latencies(kubelet, ns.n // 4, rng, allocate=not ns.cluster)  # after the restarts, still serving
        mem = memory_mb(proc.pid)
        hp = [] if ns.nvml else health_propagation(ns.health_rounds)
        result = {
            "topology": "nvml" if ns.nvml else TOPOLOGY,
            "mode": "cluster" if ns.cluster else "standalone",
            "node_pods": ns.node_pods if ns.cluster else 0,
            "gpus": len(kubelet.healthy(GPU)),
            "allocate_p50_ms": p(lat["allocate"], 0.5),
            "allocate_p99_ms": p(lat["allocate"], 0.99),
            "preferred_p50_ms": p(lat["preferred"], 0.5),
            "preferred_p99_ms": p(lat["preferred"], 0.99),
            "preferred_p50_ms_slots": p(lat["preferred_slots"], 0.5),
            "preferred_p99_ms_slots": p(lat["preferred_slots"], 0.99),
            "allocate_p99_ms_after_restarts": p(lat2["allocate"], 0.99),
            "health_propagation_ms": round(statistics.median(hp), 1) if hp else None,
            "health_propagation_max_ms": round(max(hp), 1) if hp else None,
            "reregister_ms": round(statistics.median(rr), 1),
            "reregister_max_ms": round(max(rr), 1),
            "rss_registered_mb": mem_registered["rss_mb"],
            "rss_mb": mem["rss_mb"],
            "memory_mb": mem,  # after the load: anonymous, file-backed, proportional (bench/procmem.py)
            "n": ns.n,
            # Two shared cores: p99s move with the other work on the machine; this says how busy it was.
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
            "targets": {"allocate_p99_ms": 1, "preferred_p99_ms": 5, "preferred_p99_ms_slots": 20,
                        "health_propagation_ms": 1000, "reregister_ms": 1000, "rss_mb": 60},
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        kubelet.stop()
        if api is not None:
            api.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
