"""Benchmark the DRA driver: prepare / unprepare latency over gRPC, slice republishing after a health
change, and the node daemon's memory in DRA mode.

- ``prepare_p99_ms`` (whole GPU) and ``prepare_share_p99_ms`` (consumable-capacity share with CDI
  spec writing, checkpointing and the claim GET): NodePrepareResources as the kubelet calls it
  (one claim per call, v1 service, unix socket) against a real ``kubegpu node --kubelet-plugin dra``
  process talking to the stand-in API server over HTTP. ``unprepare_p99_ms`` likewise. The calls
  come from grpcio, as the kubelet's come from grpc-go: another implementation than the daemon's
  grpclib (so the bench needs grpcio, from the ``demo`` extra).
- ``slice_publish_ms``: from an injected Xid to the tainted ResourceSlice stored in the API server
  (median and max over the repetitions), with an in-process daemon; ``slice_untaint_ms`` is the same
  for the recovery (from the GPU answering again, so it includes one health-poll interval of 50 ms).
- ``rss_registered_mb``: VmRSS of the daemon process once registered and its slices published;
  ``rss_mb``: after the prepare workload; ``daemon_grpcio``: whether grpcio's C core is mapped in
  the daemon (it should not be, ~10 MB). The daemon runs as the DRA DaemonSet runs it: the
  ``kubegpu`` entry point with ``kubegpu.node.runtime_env.NODE_ENV`` in its environment.
- ``mixed_*``: whole claims and 25 %/20Gi shares in a shuffled order (a demand no fixed split of the
  8 GPUs into "whole" and "shared" serves: 2 whole + 24 shares) through the stand-in allocator and
  kubelet to the in-process driver: ``mixed_running`` of ``mixed_claims``, ``mixed_over_capacity_gpus``
  (compute or memory summed per GPU over the allocations, target 0) and ``mixed_burst_s``.

``--nvml``: the daemon finds the node's GPUs through NVML (no ``--inventory``), as on a real GPU node; claims
go round the GPUs it publishes, and the series that need the fake backend (health, mixed) are left out.

Prints progress to stderr and one JSON object as the last line of stdout.
Usage: ``python bench/dra.py [--claims 300] [--health 10] [--nvml]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from procmem import memory_mb

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.node.dra.daemon import DraDaemon, DraOptions
from kubegpu.node.dra.names import DRIVER
from kubegpu.node.dra.proto import dra_v1_pb2 as pb
from kubegpu.node.dra.proto import dra_v1_pb2_grpc
from kubegpu.node.dra.slices import DraSettings
from kubegpu.node.runtime_env import NODE_ENV
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.dra_kubelet import DraKubelet

TOPOLOGY = "dgx-a100"
WARMUP = 20  # prepares per kind not counted
NODE = "bench-node"


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _claim(i: int, device: str, pool: str, share: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"device": device, "driver": DRIVER, "pool": pool, "request": "gpu"}
    if share:
        result["shareID"] = str(uuid.uuid4())
        result["consumedCapacity"] = {"compute": "20", "memory": "8Gi"}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"bench-{'share' if share else 'whole'}-{i}", "namespace": "default",
                         "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "shared-gpu.kubegpu.io" if share else "gpu.kubegpu.io",
                "allocationMode": "ExactCount", "count": 1}}]}},
            "status": {"allocation": {"devices": {"results": [result]}, "nodeSelector": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}}


def bench_prepare(root: Path, claims: int, nvml: bool = False) -> dict[str, Any]:
    api = ApiServer().start()
    kubelet = DraKubelet(api, root / "kubelet", NODE)
    kubelet.start()
    cmd = [sys.executable, "-c", "from kubegpu.cli.main import main; main()", "node", "--kubelet-plugin", "dra",
           *([] if nvml else ["--inventory", TOPOLOGY, "--dra-shared-gpus", "4-7"]),
           "--node-name", NODE, "--kubeconfig", str(api.write_kubeconfig(root / "kc")),
           "--dra-plugins-dir", str(root / "kubelet" / "plugins"),
           "--dra-registry-dir", str(root / "kubelet" / "plugins_registry"),
           "--cdi-spec-dir", str(root / "cdi"), "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, **NODE_ENV})
    try:
        if not kubelet.wait(lambda: DRIVER in kubelet.plugins and bool(api.objects("resourceslices",
                                                                                    "resource.k8s.io")), 60):
            raise RuntimeError("the DRA daemon did not register and publish")
        time.sleep(0.5)  # the registration's own work (the kubelet's health stream) has settled
        mem_registered = memory_mb(proc.pid)
        published = sorted(d["name"] for s in api.objects("resourceslices", "resource.k8s.io")
                           for d in s["spec"].get("devices", []) if "-mig-" not in d["name"])
        # The fake DGX A100 takes shares on GPUs 4-7 and whole claims on 0-3; a real node: every GPU, both.
        whole_gpus, share_gpus = (published, published) if nvml else ([f"gpu-{i}" for i in range(4)],
                                                                      [f"gpu-{i}" for i in range(4, 8)])
        ch = grpc.insecure_channel(f"unix://{kubelet.plugins[DRIVER].endpoint}")
        stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
        out: dict[str, Any] = {}
        unprep: list[float] = []
        for kind, share in (("whole", False), ("share", True)):
            gpus = share_gpus if share else whole_gpus
            objs = [api.put_object(_claim(i, gpus[i % len(gpus)], NODE, share))
                    for i in range(claims + WARMUP)]
            lat: list[float] = []
            for o in objs:
                m = o["metadata"]
                req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=m["namespace"], uid=m["uid"],
                                                                      name=m["name"])])
                t = time.perf_counter()
                resp = stub.NodePrepareResources(req, timeout=10)
                lat.append((time.perf_counter() - t) * 1000)
                if resp.claims[m["uid"]].error:
                    raise RuntimeError(resp.claims[m["uid"]].error)
            out[kind] = lat = lat[WARMUP:]  # the first calls open connections and fill caches
            print(f"prepare {kind}: p50 {p(lat, .5):.2f} ms p99 {p(lat, .99):.2f} ms", file=sys.stderr)
        mem = memory_mb(proc.pid)
        grpcio = "cygrpc" in Path(f"/proc/{proc.pid}/maps").read_text()
        for kind in ("whole", "share"):
            for o in api.objects("resourceclaims", "resource.k8s.io", "default"):
                m = o["metadata"]
                if kind not in m["name"]:
                    continue
                t = time.perf_counter()
                resp = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(
                    claims=[pb.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])]), timeout=10)
                unprep.append((time.perf_counter() - t) * 1000)
        ch.close()
        return {"prepare_p99_ms": round(p(out["whole"], .99), 3),
                "prepare_p50_ms": round(p(out["whole"], .5), 3),
                "prepare_share_p99_ms": round(p(out["share"], .99), 3),
                "prepare_share_p50_ms": round(p(out["share"], .5), 3),
                "unprepare_p99_ms": round(p(unprep, .99), 3),
                "rss_registered_mb": mem_registered["rss_mb"], "rss_mb": mem["rss_mb"], "memory_mb": mem,
                "daemon_grpcio": grpcio,
                "gpus": len(published),
                "claims_measured": 2 * claims, "load_avg_1m": os.getloadavg()[0],
                "cpus": os.cpu_count()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        kubelet.stop()
        api.stop()


def bench_health(root: Path, reps: int) -> dict[str, Any]:
    api = ApiServer().start()
    backend = FakeBackend(TOPOLOGY, node_name=NODE)
    opts = DraOptions(settings=DraSettings(node_name=NODE), plugins_dir=str(root / "h" / "plugins"),
                      registry_dir=str(root / "h" / "registry"), cdi_dir=str(root / "h" / "cdi"),
                      recovery_interval_s=0.05, health_wait_s=0.05)
    daemon = DraDaemon(backend, opts, make_client(api.write_kubeconfig(root / "kc2")))
    daemon.start()
    try:
        assert daemon.publisher is not None and daemon.publisher.wait_synced(30)

        def tainted() -> bool:
            s = api.objects("resourceslices", "resource.k8s.io")
            return bool(s) and "taints" in s[0]["spec"]["devices"][0]

        taint_ms: list[float] = []
        clear_ms: list[float] = []
        for _ in range(reps):
            backend.fail_probe(0)  # the GPU stays unhealthy until recover() below
            t = time.perf_counter()
            backend.inject_xid(0, 79)
            while not tainted():
                time.sleep(0.0005)
            taint_ms.append((time.perf_counter() - t) * 1000)
            time.sleep(0.1)  # longer than recovery_interval_s: the next probe decides
            t = time.perf_counter()
            backend.recover(0)
            while tainted():
                time.sleep(0.0005)
            clear_ms.append((time.perf_counter() - t) * 1000)
        print(f"taint published: median {statistics.median(taint_ms):.1f} ms max {max(taint_ms):.1f} ms; "
              f"cleared: median {statistics.median(clear_ms):.1f} ms", file=sys.stderr)
        return {"slice_publish_ms": round(statistics.median(taint_ms), 2),
                "slice_publish_max_ms": round(max(taint_ms), 2),
                "slice_untaint_ms": round(statistics.median(clear_ms), 2)}
    finally:
        daemon.stop()
        api.stop()


def bench_mixed(root: Path, seed: int = 7) -> dict[str, Any]:
    import random

    from kubegpu.install.dra import device_classes
    from kubegpu.install.values import Values
    from kubegpu.model.quantity import parse_int
    from kubegpu_standins.dra_allocator import Allocator, ClaimController

    api = ApiServer().start()
    kubelet = DraKubelet(api, root / "m" / "kubelet", NODE, retry_s=0.5)
    kubelet.start()
    opts = DraOptions(settings=DraSettings(node_name=NODE, shared_gpus=None),
                      plugins_dir=str(root / "m" / "kubelet" / "plugins"),
                      registry_dir=str(root / "m" / "kubelet" / "plugins_registry"), cdi_dir=str(root / "m" / "cdi"))
    daemon = DraDaemon(FakeBackend(TOPOLOGY, node_name=NODE), opts, make_client(api.write_kubeconfig(root / "kc3")))
    daemon.start()
    try:
        if not kubelet.wait(lambda: DRIVER in kubelet.plugins and bool(api.objects("resourceslices",
                                                                                    "resource.k8s.io")), 60):
            raise RuntimeError("the DRA daemon did not register and publish")
        for c in device_classes(Values()):
            api.put_object(c)
        alloc, ctl = Allocator(api), ClaimController(api)
        whole = {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}
        share = {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                 "capacity": {"requests": {"compute": "25", "memory": "20Gi"}}}
        demand = [whole] * 2 + [share] * 24
        random.Random(seed).shuffle(demand)
        t0 = time.perf_counter()
        pods = []
        for i, req in enumerate(demand):
            api.put_object({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                            "metadata": {"name": f"mixed-{i}", "namespace": "default"},
                            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": req}]}}})
            pod = api.put_object({"apiVersion": "v1", "kind": "Pod",
                                  "metadata": {"name": f"mixed-{i}", "namespace": "default", "uid": str(uuid.uuid4())},
                                  "spec": {"nodeName": NODE, "resourceClaims": [{"name": "gpu",
                                                                                 "resourceClaimName": f"mixed-{i}"}],
                                           "containers": [{"name": "c", "image": "x",
                                                           "resources": {"claims": [{"name": "gpu"}]}}]}})
            if ctl.schedule(alloc, pod):
                kubelet.add_pod(api.get_object("pods", pod["metadata"]["name"], "default"))
                pods.append(pod["metadata"]["uid"])
        kubelet.wait(lambda: all(u in kubelet.running for u in pods), 60)
        burst_s = time.perf_counter() - t0
        running = sum(u in kubelet.running for u in pods)
        used: dict[str, list[int]] = {}
        for c in api.objects("resourceclaims", "resource.k8s.io", "default"):
            for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
                u = used.setdefault(r["device"], [0, 0])
                u[0] += parse_int(r["consumedCapacity"]["compute"])
                u[1] += parse_int(r["consumedCapacity"]["memory"])
        over = sum(1 for c, m in used.values() if c > 100 or m > 80 * 2**30)
        print(f"mixed: {running}/{len(demand)} running in {burst_s:.2f} s, {over} GPU(s) over capacity",
              file=sys.stderr)
        return {"mixed_claims": len(demand), "mixed_running": running, "mixed_over_capacity_gpus": over,
                "mixed_gpus_used": len(used), "mixed_burst_s": round(burst_s, 3)}
    finally:
        daemon.stop()
        kubelet.stop()
        api.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--claims", type=int, default=300, help="claims prepared per kind (whole, share)")
    ap.add_argument("--health", type=int, default=10, help="health changes (Xid, then recovery)")
    ap.add_argument("--nvml", action="store_true", help="find the node's real GPUs through NVML (a GPU node)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kgb-", dir="/tmp"))
    try:
        res = bench_prepare(root, a.claims, a.nvml)
        if not a.nvml:
            res.update(bench_health(root, a.health))
            res.update(bench_mixed(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.update({"topology": "nvml" if a.nvml else TOPOLOGY, "targets": {"prepare_p99_ms": 5, "prepare_share_p99_ms": 10,
                                                  "slice_publish_ms": 1000, "rss_mb": 60,
                                                  "mixed_over_capacity_gpus": 0}})
    print(json.dumps(res))


if __name__ == "__main__":
    main()
