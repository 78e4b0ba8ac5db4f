"""Benchmark of the handoff under the recorded kubelet's behaviour: bursts of pods on two GPU nodes.

The stand-in API server, the extender and, per node, the real ``kubegpu node`` daemon with a stand-in
kubelet that admits bound pods in its watch order with adjacent swaps (``kubegpu_standins.gpu_cluster``).
Each burst mixes identical shares, whole GPUs, multi-GPU shares, init-container pods, MIG devices,
time-slicing replica pods (``nvidia.com/gpu.shared`` on a third node whose GPUs are all time-sliced), pods
from the default scheduler and pods carrying forged records; the node daemons' pod watches lag the
kubelet's by up to ``--lag`` seconds; a node daemon restarts during one burst, the extender during another,
and kubelets restart mid-burst (as recorded: checkpoint kept, plugin sockets deleted, every plugin must
register again). After each burst every GPU container is checked: environment GPUs, the kubelet's devices,
the record the accounting uses and the acknowledgement (replica containers: environment GPUs = kubelet
devices, no record). Prints one JSON object as its last line: ``pods``, ``containers``, ``divergent``
(target 0), ``silent_divergent`` (target 0), ``overcommitted_gpus`` (target 0), ``refused_without_reason``
(target 0), ``forged_served`` (target 0), ``bound_pending`` (target 0: pods bound and still Pending once the
nodes are quiet), ``allocate_p99_ms``, ``max_watch_lag_s``, plus ``refused``,
``served``, ``replica_containers``, ``records_on_replicated`` (target 0), ``double_held`` (target 0),
``checkpoint_violations`` (target 0: devices held at a kubelet restart offered to another container),
``kubelet_restarts``, ``consistent_reads``, ``elapsed_s``.

kube-scheduler is the stand-in's model of v1.36's queue (``kubegpu_standins.scheduler.SchedulingQueue``):
asynchronous binds (the next pod is filtered before the previous bind reaches the extender), back-off 1 s
doubling to 10 s after a failed bind, unschedulable pods requeued by any cluster event. Issue 24's keys:
``async_bind_pairs`` (binds issued while a pod of the same shape on that node was bound and unacknowledged;
target >= 20, the race is reproduced), ``swapped_records_served`` (containers served on other GPUs than their
own record names; target 0), and two timed scenarios on fresh clusters:

- ``admission_s_p50_at_lag``: one 8-GPU node whose daemon is 1.5 s behind the API server (1.5 s one way on
  its API connection and its watch), 8 identical 25 % shares and 4 whole GPUs; per pod, seconds from its
  bind to the kubelet's last ``Allocate`` answer (target <= 3 s), also per kind
  (``admission_s_p50_at_lag_share``, ``admission_s_p50_at_lag_whole``), and ``ack_lag_s_p99_at_lag``: seconds
  from a pod's ``Allocate`` answer until its acknowledgement is on the API server (target: one round trip, 3 s;
  ``ack_lag_round_trips_p99_at_lag`` is the same in round trips, seen to within the 10 ms the API is polled at),
  and ``bind_failures_at_lag`` (target 0: a pod that only waits for its node's previous handoff waits in bind);
- ``burst_64_shares_s``: a Deployment-like burst of 64 identical 25 % shares on two 8-GPU nodes, 100 ms one
  way between every component and the API server; seconds from the first create until every container has
  its ``Allocate`` answer (target <= 30 s).

    .venv/bin/python bench/handoff.py [--bursts 6] [--pods 30] [--lag 2.0] [--seed 1] [--burst-pods 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from typing import Any

from kubegpu.kube import Pod
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu_standins.gpu_cluster import SCHEDULER_NAME, GpuCluster, NodeSpec, pod, share, whole

MIG = {"nvidia.com/mig-1g.10gb": "1"}
REPLICA = {R.NVIDIA_GPU_SHARED: "1"}
LAG_ONE_WAY_S = 1.5  # the timed lag scenario's one-way delay between the node daemon and the API server
TIME_SLICING = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                "    - name: nvidia.com/gpu\n      replicas: 4\n")


def burst(rng: random.Random, b: int, n: int, victim_gpu: str | None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    pods: list[dict[str, Any]] = []
    forged: dict[str, str] = {}
    kinds = ["share", "share", "share", "whole", "multi", "init", "mig", "default", "two", "replica", "replica"]
    same = rng.choice([10, 20, 25, 30])
    for i in range(n):
        name = f"b{b}-{i}"
        k = rng.choice(kinds) if i >= n // 3 else "share"  # a third are identical shares
        if k == "share":
            pods.append(pod(name, share(same if i < n // 3 else rng.choice([10, 15, 20, 40]))))
        elif k == "whole":
            pods.append(pod(name, whole(rng.choice([1, 1, 2]))))
        elif k == "multi":
            pods.append(pod(name, share(rng.choice([20, 40]), k=2)))
        elif k == "init":
            pods.append(pod(name, share(20), init=[share(rng.choice([10, 30]))]) if rng.random() < 0.5
                        else pod(name, whole(1), init=[whole(1)]))
        elif k == "mig":
            pods.append(pod(name, MIG))
        elif k == "default":
            pods.append(pod(name, whole(1), scheduler=None))
        elif k == "replica":
            pods.append(pod(name, REPLICA, scheduler=None if rng.random() < 0.3 else SCHEDULER_NAME))
        else:
            pods.append(pod(name, whole(1), share(10)))
    if victim_gpu is not None:
        record = json.dumps({"gpu": [{"minor": 0, "id": victim_gpu, "resources": {
            R.GPU_CORE: "100", R.GPU_MEMORY: "80Gi", R.GPU_MEMORY_RATIO: "100"}}]})
        for j, res in enumerate((whole(1), share(10))):
            name = f"b{b}-forged-{j}"
            pods.append(pod(name, res, scheduler=None, annotations={
                A.DEVICE_ALLOCATED: record, "kubegpu.io/device-allocated-signature": "0" * 64}))
            forged[name] = victim_gpu
    return pods, forged


def lag_scenario(seed: int) -> dict[str, Any]:
    """Per pod, bind -> the kubelet's last Allocate answer, with the node daemon 1.5 s behind."""
    spec = NodeSpec("node-lag", "dgx-a100", watch_lag_s=LAG_ONE_WAY_S, api_latency_s=LAG_ONE_WAY_S)
    with GpuCluster([spec], swap_prob=0.3, seed=seed) as c:
        pods = [pod(f"lag-s{i}", share(25)) for i in range(8)] + [pod(f"lag-w{i}", whole(1)) for i in range(4)]
        names = {p["metadata"]["name"] for p in pods}
        acked: dict[str, float] = {}  # pod -> when its acknowledgement was first seen on the API server
        stop = threading.Event()

        def watch_acks() -> None:
            while not stop.is_set() and len(acked) < len(names):
                now = time.monotonic()
                for o in c.api.objects("pods"):
                    n = o["metadata"]["name"]
                    if n in names and n not in acked and A.DEVICE_ASSIGNED in (o["metadata"].get("annotations") or {}):
                        acked[n] = now
                stop.wait(0.01)

        poller = threading.Thread(target=watch_acks, daemon=True)
        poller.start()
        for p in pods:
            c.create(p)
        settled = c.settled(names, timeout_s=240)
        bound = {k.split("/", 1)[1]: t for t, k, _n in c.binds}
        res = c.nodes["node-lag"].admitter.results
        done = {r.pod.split("/", 1)[1]: r.done_at for r in res.values() if r.ok and r.pod.split("/", 1)[1] in bound}
        lat = sorted(t - bound[n] for n, t in done.items())
        by_kind = {kind: sorted(t - bound[n] for n, t in done.items() if n.startswith(prefix))
                   for kind, prefix in (("share", "lag-s"), ("whole", "lag-w"))}
        deadline = time.monotonic() + 60  # acknowledgements land a round trip (3 s) after the answers
        while True:
            checks = [k for k in c.check() if k.pod.split("/")[1] in names]
            if not any(k.divergent for k in checks) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        poller.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        ack_lag = sorted(acked[n] - t for n, t in done.items() if n in acked)
        return {"settled": settled, "latencies": lat, "by_kind": by_kind, "ack_lag": ack_lag,
                "unacknowledged": len(done) - len(ack_lag), "bind_failures": c.queue.bind_failures,
                "swapped": sum(k.swapped for k in checks),
                "divergent": sum(k.divergent for k in checks), "over": c.overcommitted(),
                "pairs": c.async_bind_pairs, "served": sum(k.outcome == "served" for k in checks)}


def burst_scenario(n: int, seed: int) -> dict[str, Any]:
    """``n`` identical 25 % shares on two 8-GPU nodes, 100 ms one way to the API server for everyone."""
    specs = [NodeSpec(f"node-{x}", "dgx-a100", watch_lag_s=0.1) for x in ("p", "q")]
    with GpuCluster(specs, swap_prob=0.3, seed=seed) as c:
        c.api.latency_s = 0.1
        t0 = time.monotonic()
        for i in range(n):
            c.create(pod(f"burst-{i}", share(25)))
        names = {f"burst-{i}" for i in range(n)}
        settled = c.settled(names, timeout_s=300)
        done = [r.done_at for node in c.nodes.values() for r in node.admitter.results.values()
                if r.ok and r.pod.split("/", 1)[1] in names]
        deadline = time.monotonic() + 30  # the last acknowledgements land a round trip after the answers
        while True:
            checks = [k for k in c.check() if k.pod.split("/")[1] in names]
            if not any(k.divergent for k in checks) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {"settled": settled and len(done) == n, "seconds": (max(done) - t0) if done else float("nan"),
                "swapped": sum(k.swapped for k in checks), "divergent": sum(k.divergent for k in checks),
                "over": c.overcommitted(), "pairs": c.async_bind_pairs, "served": len(done),
                "bind_failures": c.queue.bind_failures, "attempts": c.queue.attempts}


def p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--pods", type=int, default=30, help="pods per burst")
    ap.add_argument("--lag", type=float, default=2.0, help="the slowest node daemon's watch lag, seconds")
    ap.add_argument("--swap", type=float, default=0.4, help="probability of an adjacent admission swap")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--burst-pods", type=int, default=64, help="identical shares in the timed burst (0: skip)")
    ap.add_argument("--no-lag-scenario", action="store_true", help="skip admission_s_p50_at_lag")
    args = ap.parse_args(argv)
    if args.bursts < 1 or args.pods < 1 or args.lag < 0 or not 0 <= args.swap <= 1:
        ap.error("--bursts and --pods must be positive, --lag >= 0, --swap in [0, 1]")
    logging.basicConfig(level=logging.CRITICAL)
    if os.environ.get("KUBEGPU_BENCH_LOG"):
        logging.getLogger("kubegpu").setLevel(os.environ["KUBEGPU_BENCH_LOG"])
    rng = random.Random(args.seed)
    nodes = [NodeSpec("node-a", "dgx-a100", watch_lag_s=args.lag),
             NodeSpec("node-b", "a100-mig", flags={"mig-strategy": "mixed"}, watch_lag_s=args.lag / 4),
             NodeSpec("node-c", "t4x4", flags={"shared-slots": 0}, config_yaml=TIME_SLICING,
                      watch_lag_s=args.lag / 2)]
    out: dict[str, Any] = {"pods": 0, "containers": 0, "divergent": 0, "silent_divergent": 0,
                           "overcommitted_gpus": 0, "refused_without_reason": 0, "forged_served": 0,
                           "refused": 0, "served": 0, "unschedulable": 0, "replica_containers": 0,
                           "swapped_records_served": 0, "async_bind_pairs": 0, "bound_pending": 0}
    t0 = time.monotonic()
    over: set[str] = set()
    on_replicated: set[str] = set()
    double: set[str] = set()
    offered: set[str] = set()
    reasons: dict[str, int] = {}
    with GpuCluster(nodes, swap_prob=args.swap, seed=args.seed) as c:
        victim: str | None = None
        keep: str | None = None
        previous: list[str] = []
        for b in range(args.bursts):
            pods, forged = burst(rng, b, args.pods, victim)
            for name in previous:  # the previous burst leaves (but the pod whose GPU the forgers name)
                if name != keep:
                    c.client.delete(Pod, name, namespace="default")
            restart: threading.Thread | None = None
            kubelets: list[threading.Thread] = []
            for i, p in enumerate(pods):
                c.create(p)
                if i == len(pods) // 2 and b % 3 == 1:
                    restart = threading.Thread(target=c.nodes["node-a"].restart_daemon)
                elif i == len(pods) // 2 and b % 3 == 2:
                    restart = threading.Thread(target=c.restart_extender)
                if restart is not None and not restart.is_alive() and restart.ident is None:
                    restart.start()
                # Kubelet restarts: node-a's and node-c's mid-way through every third burst, node-b's
                # three quarters through the bursts with an extender restart.
                which = (["node-a", "node-c"] if i == len(pods) // 2 and b % 3 == 0 and b > 0 else
                         ["node-b"] if i == 3 * len(pods) // 4 and b % 3 == 2 else [])
                for n in which:
                    time.sleep(0.3)  # let the kubelet admit part of the burst first
                    kubelets.append(threading.Thread(target=c.nodes[n].restart_kubelet))
                    kubelets[-1].start()
            for t in [*([restart] if restart is not None else []), *kubelets]:
                t.join(60)
            names = {p["metadata"]["name"] for p in pods}
            if not c.settled(names, timeout_s=60, idle_s=6.0):
                stuck = [n for n in sorted(names) if n in c.why_pending][:3]
                print(f"burst {b}: unschedulable, e.g. " + "; ".join(f"{n}: {c.why_pending[n]}" for n in stuck),
                      file=sys.stderr)
                if os.environ.get("KUBEGPU_BENCH_DEBUG"):
                    print("DEBUG errors", c.schedule_errors[-3:], file=sys.stderr)
                if os.environ.get("KUBEGPU_BENCH_DEBUG") and c.ext is not None and c.ext.service is not None:
                    v = c.ext.service.view
                    for nn, node in c.nodes.items():
                        hold = {pk: {cn: [(r, [i[-4:] for i in ids]) for r, ids in v] for cn, v in cs.items()}
                                for pk, cs in node.kubelet.holdings.items()}
                        print("DEBUG kubelet", nn, {k: v for k, v in hold.items() if v}, file=sys.stderr)
                    print("DEBUG extender", c.ext.call(lambda v=v: {k: (h.node, [g.uuid[-4:] + ":" + str(g.core)
                                                                           for g in h.alloc.grants()])
                                                                  for k, h in v.held.items()}), file=sys.stderr)
                    for n in stuck:
                        p = c.api.get_object("pods", n, "default")
                        r = c.http.post(f"{c.ext.url}/scheduler/filter", json={"Pod": p, "Nodes": None,
                                                                               "NodeNames": list(c.nodes)}).json()
                        print("DEBUG now", n, p["spec"].get("nodeName"), p.get("status"), str(r)[:600], file=sys.stderr)
                out["unschedulable"] += sum(1 for p in c.api.objects("pods") if p["metadata"]["name"] in names
                                        and (p.get("status") or {}).get("phase") == "Pending")
            c.quiesce(15)
            checks = [k for k in c.check() if k.pod.split("/")[1] in names]
            events = {(e.get("involvedObject") or {}).get("name") for e in c.api.objects("events")
                      if e.get("reason") in ("GpuHandoffMismatch", "GpuHandoffReordered")}
            mine = [p for p in c.api.objects("pods") if p["metadata"]["name"] in names]
            phases = [(p.get("status") or {}).get("phase") for p in mine]
            # Bound and still Pending once the node has gone quiet: a pod left waiting for nothing (target 0;
            # the other Pending pods found no room, the bursts ask more than the nodes have).
            waiting = [p["metadata"]["name"] for p in mine if (p.get("status") or {}).get("phase") == "Pending"
                       and (p.get("spec") or {}).get("nodeName")]
            out["bound_pending"] += len(waiting)
            print(f"burst {b}: {len(pods)} pods, {phases.count('Running')} running, {phases.count('Failed')} "
                  f"refused, {phases.count('Pending')} pending ({len(waiting)} of them bound"
                  f"{': ' + ', '.join(waiting[:4]) if waiting else ''})", file=sys.stderr)
            out["pods"] += len(pods)
            out["containers"] += len(checks)
            for k in checks:
                name = k.pod.split("/")[1]
                if k.swapped:
                    out["swapped_records_served"] += 1
                    print(f"swapped: {k}", file=sys.stderr)
                if k.divergent:
                    out["divergent"] += 1
                    print(f"divergent: {k}", file=sys.stderr)
                    if name not in events:
                        out["silent_divergent"] += 1
                if k.outcome == "refused":
                    out["refused"] += 1
                    why = k.reason.split("kubegpu: ", 1)[-1][:48] if "kubegpu: " in k.reason else k.reason[:48]
                    reasons[why] = reasons.get(why, 0) + 1
                    if not k.reason.strip():
                        out["refused_without_reason"] += 1
                elif k.outcome == "served":
                    out["served"] += 1
                if k.replica:
                    out["replica_containers"] += 1
                if name in forged and forged[name] in k.env_gpus:
                    out["forged_served"] += 1
            for o in c.overcommitted():
                if o not in over:
                    print(f"overcommitted after burst {b}: {o}", file=sys.stderr)
                over.add(o)
            for found, seen, what in ((c.records_on_replicated(), on_replicated, "record on a replicated GPU"),
                                      (c.double_held(), double, "held twice by the kubelet"),
                                      ([o for n in c.nodes.values() for o in n.offered_after_restart()], offered,
                                       "held at a kubelet restart, offered again")):
                for o in found:
                    if o not in seen:
                        print(f"{what} after burst {b}: {o}", file=sys.stderr)
                    seen.add(o)
            served = [k for k in checks if k.outcome == "served" and k.env_gpus and k.pod.split("/")[1] not in forged]
            if served and keep is None:
                victim, keep = served[0].env_gpus[0], served[0].pod.split("/")[1]
            previous = sorted(names)
        lat = [r.latency_s * 1000 for n in c.nodes.values() for r in list(n.kubelet.calls)
               if r.rpc.endswith("/Allocate") and r.latency_s is not None]
        out["allocate_p99_ms"] = round(p99(lat), 2)
        out["allocate_calls"] = len(lat)
        out["consistent_reads"] = int(sum(n.resolver.metrics.consistent_reads._value.get() for n in c.nodes.values()))
        out["node_daemon_restarts"] = sum(n.daemon_restarts for n in c.nodes.values())
        out["extender_restarts"] = c.extender_restarts
        out["kubelet_restarts"] = sum(n.kubelet_restarts for n in c.nodes.values())
        out["async_bind_pairs"] += c.async_bind_pairs
        out["bind_failures"] = c.queue.bind_failures
        out["requeued_by_event"] = c.queue.requeued_by_event
    if not args.no_lag_scenario:
        lag = lag_scenario(args.seed)
        print(f"lag scenario: {lag}", file=sys.stderr)
        out["admission_s_p50_at_lag"] = round(p50(lag["latencies"]), 2)
        out["admission_s_max_at_lag"] = round(max(lag["latencies"], default=float("nan")), 2)
        for kind, xs in lag["by_kind"].items():
            out[f"admission_s_p50_at_lag_{kind}"] = round(p50(xs), 2)
        out["ack_lag_s_p99_at_lag"] = round(p99(lag["ack_lag"]), 2)
        out["ack_lag_round_trips_p99_at_lag"] = round(p99(lag["ack_lag"]) / (2 * LAG_ONE_WAY_S), 3)
        out["unacknowledged_at_lag"] = lag["unacknowledged"]
        out["bind_failures_at_lag"] = lag["bind_failures"]  # binds that failed (a Warning, a back-off) at 1.5 s lag
        out["lag_pods_served"] = lag["served"]
        out["async_bind_pairs"] += lag["pairs"]
        out["swapped_records_served"] += lag["swapped"]
        out["divergent"] += lag["divergent"]
        over.update(lag["over"])
    if args.burst_pods > 0:
        bs = burst_scenario(args.burst_pods, args.seed)
        print(f"burst scenario: { {k: v for k, v in bs.items()} }", file=sys.stderr)
        out["burst_64_shares_s" if args.burst_pods == 64 else f"burst_{args.burst_pods}_shares_s"] = round(
            bs["seconds"], 1) if bs["settled"] else None
        out["burst_bind_failures"] = bs["bind_failures"]
        out["async_bind_pairs"] += bs["pairs"]
        out["swapped_records_served"] += bs["swapped"]
        out["divergent"] += bs["divergent"]
        over.update(bs["over"])
    out["overcommitted_gpus"] = len(over)
    out["records_on_replicated"] = len(on_replicated)
    out["double_held"] = len(double)
    out["checkpoint_violations"] = len(offered)
    out["max_watch_lag_s"] = args.lag
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    out["refusal_reasons"] = reasons
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
