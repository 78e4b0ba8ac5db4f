"""What each way of enforcing GPU shares with MPS costs in placement, on the FGD paper's pod lists.

Four modes (docs/sharing.md, "Enforcement modes"):

- ``none``: placement as today; every share can take its whole GPU (nothing binds it);
- ``per-shape``: placement as today; one MPS server per share shape on a GPU (binding, but GPUs in the
  DEFAULT compute mode, so a container that skips its server escapes; servers on one GPU time-slice);
- ``strict-ceiling``: placement as today; one server per GPU whose defaults are the GPU's largest share, so a
  share can raise itself up to the largest share beside it (a bounded escape);
- ``strict-shape-lock``: one share shape per GPU at a time (placement/shape_lock.py); nothing escapes.

Per list: unallocated GPU % at arrived 100 %, pods turned away up to arrived 100 %, and what a tenant could
take beyond its share (mean over shares, % of a GPU's compute) and how many servers share a GPU.
``python -m kubegpu.sim.enforcement_study [--lists default|paper] [--seeds N]`` prints a table and, as its
last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kubegpu.placement.cluster import MILLI
from kubegpu.sim.replay import ReplayResult, replay
from kubegpu.sim.study import PAPER_LISTS
from kubegpu.sim.trace import TraceNodes, TracePod, default_path, load_nodes, load_pods

MODES: tuple[str, ...] = ("none", "per-shape", "strict-ceiling", "strict-shape-lock")
AT_PCT = 100.0


def _upto(r: ReplayResult) -> int:
    """How many arrivals it took to reach arrived ``AT_PCT`` (all of them if never)."""
    return min(len(r.arrived_pct), int(np.searchsorted(r.arrived_pct, AT_PCT - 1e-9)) + 1)


def _gpu_shares(r: ReplayResult, pods: Sequence[TracePod], n: int) -> dict[tuple[int, int], list[int]]:
    """(node row, slot) -> the compute milli of each share placed there among the first ``n`` arrivals."""
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    for k in range(n):
        where = r.placements[k]
        d = pods[r.order[k]].demand
        if where is None or not d.is_share:
            continue
        for j in where[1]:
            out[(where[0], j)].append(d.milli)
    return out


def measure(r: ReplayResult, pods: Sequence[TracePod], mode: str) -> dict[str, float]:
    """One mode's numbers from one replay (``r`` recorded; shape-locked for ``strict-shape-lock``)."""
    n = _upto(r)
    turned_away = sum(1 for k in range(n) if r.placements[k] is None)
    shares = _gpu_shares(r, pods, n)
    excess: list[int] = []
    for held in shares.values():
        top = max(held)
        for m in held:
            excess.append(MILLI - m if mode == "none" else top - m if mode == "strict-ceiling" else 0)
    servers = [len(set(held)) if mode == "per-shape" else 1 for held in shares.values()]
    unalloc = r.unallocated_at(AT_PCT)
    return {
        "unallocated_pct_at_100": round(unalloc, 3) if unalloc is not None else float("nan"),
        "turned_away_at_100": float(turned_away),
        "escapable_shares_pct": round(100.0 * sum(e > 0 for e in excess) / len(excess), 2) if excess else 0.0,
        "escape_pct_of_gpu_mean": round(100.0 * float(np.mean(excess)) / MILLI, 2) if excess else 0.0,
        "servers_per_shared_gpu_mean": round(float(np.mean(servers)), 3) if servers else 0.0,
        "shared_gpus_time_sliced_pct": round(100.0 * sum(s > 1 for s in servers) / len(servers), 2)
        if servers else 0.0,
    }


def study_list(nodes: TraceNodes, pods: Sequence[TracePod], policy: str, seeds: Sequence[int]) -> dict[str, Any]:
    """Every mode on one pod list, averaged over ``seeds``."""
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for seed in seeds:
        base = replay(nodes, pods, policy, seed, record=True)
        locked = replay(nodes, pods, policy, seed, record=True, shape_locks=True)
        for m in MODES:
            per_mode[m].append(measure(locked if m == "strict-shape-lock" else base, pods, m))
    return {m: {k: round(float(np.mean([v[k] for v in runs])), 3) for k in runs[0]} for m, runs in per_mode.items()}


def run(lists: Sequence[str], policy: str = "kubegpu", seeds: Sequence[int] = (42,),
        trace_dir: str = "") -> dict[str, Any]:
    """``trace_dir``: where the openb lists are (the package holds only the default list and node list)."""
    nodes = load_nodes()
    out: dict[str, Any] = {"policy": policy, "seeds": list(seeds), "at_arrived_pct": AT_PCT, "lists": {}}
    for name in lists:
        file = f"openb_pod_list_{name}.csv"
        path = Path(trace_dir) / file if trace_dir else default_path(file)
        out["lists"][name] = study_list(nodes, load_pods(path), policy, seeds)
        print(f"{name}: " + "  ".join(f"{m} {v['unallocated_pct_at_100']:.2f}%/{v['turned_away_at_100']:.0f}"
                                      for m, v in out["lists"][name].items()), file=sys.stderr, flush=True)
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: per list and mode, unallocated % at arrived 100 % / pods turned away."""
    head = "| list | " + " | ".join(MODES) + " |"
    rows = [head, "|" + "---|" * (len(MODES) + 1)]
    for name, modes in result["lists"].items():
        rows.append(f"| {name} | " + " | ".join(
            f"{modes[m]['unallocated_pct_at_100']:.2f} % / {modes[m]['turned_away_at_100']:.0f}" for m in MODES) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kubegpu.sim.enforcement_study", description=__doc__)
    ap.add_argument("--lists", default="default",
                    help="'default', 'paper' (the 17 lists of the FGD paper) or comma-separated list names")
    ap.add_argument("--policy", default="kubegpu")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--trace-dir", default="", help="directory of the openb pod lists (default: the packaged one)")
    a = ap.parse_args(argv)
    lists = list(PAPER_LISTS) if a.lists == "paper" else a.lists.split(",")
    result = run(lists, a.policy, [42 + i for i in range(a.seeds)], a.trace_dir)
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
