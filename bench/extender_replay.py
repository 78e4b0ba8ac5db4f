"""Benchmark and proof: the real extender, driven over HTTP like kube-scheduler drives it, places every pod of
the openb trace where ``kubegpu simulate`` places it.

A stand-in API server holds the 1,213 GPU nodes of the packaged openb node list as Device objects; the
extender (``ServiceThread``: informers + the HTTP app, as ``kubegpu scheduler`` runs them) watches it. The
stand-in kube-scheduler (:mod:`kubegpu_standins.trace_scheduler`) sends, pod by pod in the paper's arrival
order (seed 42, resampled to ``--inflate`` x GPU capacity), filter -> prioritize -> bind with the bodies
kube-scheduler sends. The simulator replays the same order with the same workload learned online from the
pods placed (``replay(..., learned=True, ties="name")``). Prints one JSON object as its last line: ``pods``,
``node_agreement_pct``, ``gpu_agreement_pct`` (targets 100), ``unallocated_pct_at_100`` for the extender and
the simulator, ``pods_per_s`` (the whole loop: three verbs, the pod's creation and its read-back), verb
latency percentiles, and ``control_gpu_agreement_pct``: the simulator with the trace's full workload instead
of the learned one, to show the comparison can tell workloads apart.

    .venv/bin/python bench/extender_replay.py [--policy kubegpu] [--seed 42] [--inflate 1.02] [--pods N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from kubegpu.placement.cluster import MILLI
from kubegpu.sim.replay import arrival_order, replay
from kubegpu.sim.trace import load_nodes, load_pods
from kubegpu_standins.trace_scheduler import TraceScheduler, agreement, start_replay_cluster


def unallocated_at_100(pods: list, order: list[int], placed: list[bool], capacity: int) -> float | None:
    req = np.array([pods[i].demand.gpu_milli_total for i in order], np.int64)
    arrived = np.cumsum(req)
    allocated = np.cumsum(np.where(placed, req, 0))
    k = int(np.searchsorted(arrived, capacity))
    if k >= len(order):
        return None
    return round(100.0 - 100.0 * float(allocated[k]) / capacity, 3)


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="kubegpu")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--inflate", type=float, default=1.02)
    ap.add_argument("--pods", type=int, default=0, help="stop after this many pods (0: the whole order)")
    args = ap.parse_args()
    nodes = load_nodes().gpu_only()
    pods = load_pods()
    capacity = nodes.total_gpus * MILLI
    order = arrival_order(pods, capacity, args.seed, args.inflate)
    if args.pods:
        order = order[: args.pods]
    sim = replay(nodes, pods, args.policy, args.seed, learned=True, ties="name", record=True, order=order)
    print(f"simulator: {sim.seconds:.1f} s for {len(order)} pods", file=sys.stderr, flush=True)
    control = replay(nodes, pods, args.policy, args.seed, ties="name", record=True, order=order)
    with tempfile.TemporaryDirectory() as tmp:
        api, ext = start_replay_cluster(nodes, Path(tmp), args.policy)
        try:
            out = TraceScheduler(api, ext.url, nodes).run(pods, order)
            learned = ext.call(lambda: ext.service.view.scoring.learner.summary())
        finally:
            ext.stop()
            api.stop()
    print(f"extender: {out.seconds:.1f} s", file=sys.stderr, flush=True)
    node_pct, gpu_pct, differ = agreement(sim.placements, out.placements, nodes.names)
    _, control_gpu_pct, _ = agreement(control.placements, out.placements, nodes.names)
    for k in differ[:5]:
        print(f"differs at pod {k}: simulator {sim.placements[k]}, extender {out.placements[k]}", file=sys.stderr)
    lat = {verb: np.asarray(v) * 1000 for verb, v in out.verb_seconds.items() if v}
    return {
        "policy": args.policy,
        "seed": args.seed,
        "nodes": len(nodes.names),
        "pods": len(order),
        "node_agreement_pct": round(node_pct, 3),
        "gpu_agreement_pct": round(gpu_pct, 3),
        "pods_differing": len(differ),
        "unallocated_pct_at_100": {
            "extender": unallocated_at_100(pods, order, [p is not None for p in out.placements], capacity),
            "simulator": unallocated_at_100(pods, order, [p is not None for p in sim.placements], capacity),
            "simulator_trace_workload": unallocated_at_100(
                pods, order, [p is not None for p in control.placements], capacity),
        },
        "control_gpu_agreement_pct": round(control_gpu_pct, 3),
        "pods_per_s": round(len(order) / max(out.seconds, 1e-9), 1),
        **{f"{verb}_p50_ms": round(float(np.percentile(v, 50)), 2) for verb, v in lat.items()},
        **{f"{verb}_p99_ms": round(float(np.percentile(v, 99)), 2) for verb, v in lat.items()},
        "simulator_seconds": round(sim.seconds, 2),
        "workload_generations": learned["generation"],
        "machine": "2 cores shared with other work; timings are indicative",
    }


if __name__ == "__main__":
    print(json.dumps(main()))
