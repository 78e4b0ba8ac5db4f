"""Benchmark: the packing floor under the unallocated GPU at arrived 100 %, per openb pod list and seed.

For each (list, seed) it takes the pods that have arrived when the GPU request
reaches 100 % of capacity (the paper's protocol, as ``kubegpu simulate`` and
``bench/quality.py`` replay it) and solves exactly how little compute a perfect
offline packer would leave free between their shares
(:func:`kubegpu.sim.bound.share_packing_floor`). No placement, online or
offline, gets below it unless shares are turned away. With ``--cache`` (the
JSON-lines file of ``bench/quality.py``) each policy's measured result is
shown beside the floor.

Usage: ``python bench/packing_bound.py [--seeds 100-109] [--lists default,...] [--traces DIR] [--cache FILE]``.
Prints one line per list, then ONE JSON object as the last line:
``{"seeds": [...], "lists": {LIST: {"floor_pct": mean, "floor_pct_by_seed": {...}, "optimal": bool,
"measured_pct": {POLICY: mean}}}}``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from quality import parse_seeds, study_arguments  # bench/ is on the path when run as a script

from kubegpu.placement.cluster import MILLI
from kubegpu.sim.bound import share_packing_floor
from kubegpu.sim.replay import arrival_order
from kubegpu.sim.trace import load_nodes, load_pods


def arrived_shares(pods: list[Any], capacity: int, seed: int) -> Counter[int]:
    """Share sizes (milli, one entry per GPU part) among the pods arrived when the request reaches 100 %."""
    total = 0
    shares: Counter[int] = Counter()
    for i in arrival_order(pods, capacity, seed, 1.3):
        d = pods[i].demand
        total += d.gpu_milli_total
        if d.is_share:
            shares[d.milli] += d.count
        if total >= capacity:
            break
    return shares


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = study_arguments(__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, help="bench/quality.py's JSON-lines results, shown beside the floor")
    args = ap.parse_args(argv)
    seeds, lists = parse_seeds(args.seeds), args.lists.split(",")
    measured: dict[tuple[str, str], list[float]] = {}
    if args.cache and args.cache.exists():
        for line in args.cache.read_text().splitlines():
            rec = json.loads(line)
            if rec["seed"] in seeds and rec["unalloc"]["100"] is not None:
                measured.setdefault((rec["list"], rec["policy"]), []).append(rec["unalloc"]["100"])
    cluster = load_nodes().gpu_only().cluster()
    capacity = int(cluster.gpu_ok.sum()) * MILLI
    out: dict[str, Any] = {"seeds": seeds, "lists": {}}
    for name in lists:
        path = args.traces / f"openb_pod_list_{name}.csv"
        if not path.is_file():
            ap.error(f"no pod list {name} under {args.traces} (--traces)")
        pods = load_pods(path)
        by_seed: dict[str, float] = {}
        optimal = True
        for seed in seeds:
            floor = share_packing_floor(arrived_shares(pods, capacity, seed))
            by_seed[str(seed)] = round(floor.waste_pct(capacity), 4)
            optimal &= floor.optimal
        mean = round(sum(by_seed.values()) / len(by_seed), 4)
        got = {p: round(sum(v) / len(v), 4) for (n, p), v in measured.items() if n == name}
        out["lists"][name] = {"floor_pct": mean, "floor_pct_by_seed": by_seed, "optimal": optimal, "measured_pct": got}
        print(
            f"{name:12s} floor {mean:.3f} %  " + "  ".join(f"{p} {v:.3f}" for p, v in sorted(got.items())),
            file=sys.stderr,
            flush=True,
        )
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
