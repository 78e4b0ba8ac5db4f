"""Benchmark: placement quality with the FGD paper's protocol, on the paper's 17 openb pod lists.

Every (list, seed, policy) replay runs the paper's protocol (pods shuffled by
the seed and resampled to 130 % of GPU capacity, GPU nodes only, ties broken
by a random node order) and records the unallocated GPU % when the arrived GPU
request reaches 80, 90, 95 and 100 % of capacity, and how many large pods
(more than one whole GPU) were turned away by then. The per-list means over
seeds are compared with ``fgd`` (the paper's FGD, which kubegpu reproduces pod
for pod).

Usage: ``python bench/quality.py [--seeds 100-109] [--lists default,cpu250] [--traces DIR]
[--policies fgd,kubegpu] [--jobs 2] [--cache FILE] [--learned]``. Seeds 100-109 are the
measuring seeds: no constant of any policy was chosen on them (see
``docs/placement.md``). ``--cache`` keeps finished replays in a JSON-lines
file so an interrupted study resumes.

Prints one line per list, then ONE JSON object as the last line:
``{"seeds": [...], "lists": {LIST: {POLICY: {"unallocated_pct_at": {"80": x, ...},
"large_turned_away_at": {...}}}}, "kubegpu_below_fgd_at_100": {LIST: bool},
"kubegpu_not_worse_than_fgd_before_full": {LIST: bool}, "kubegpu_no_more_large_turned_away": {LIST: bool}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kubegpu.sim.study import PAPER_LISTS

CHECKS: tuple[int, ...] = (80, 90, 95, 100)


def study_arguments(description: str) -> argparse.ArgumentParser:
    """The options every study over openb lists and seeds takes (``packing_bound.py`` uses them too)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seeds", default="100-109", help="seeds, e.g. 100-109 or 1,2,3 (default: 100-109)")
    ap.add_argument("--lists", default=",".join(PAPER_LISTS), help="pod lists (default: the paper's 17)")
    ap.add_argument(
        "--traces",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb",
        help="folder of the openb pod lists (default: ../shared/traces/openb beside the checkout)",
    )
    return ap


def parse_seeds(text: str) -> list[int]:
    """``100-109`` or ``1,2,5-7`` as a list of seeds."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def one(job: tuple[str, int, str, str] | tuple[str, int, str, str, bool]) -> dict[str, Any]:
    """Replay one (list, seed, policy[, learned]) and measure it at the checkpoints.

    ``learned``: score with the workload learned online from the pods placed so far (what a running
    extender has) instead of the pod list's (the paper's protocol).
    """
    from kubegpu.sim.replay import replay, target_workload
    from kubegpu.sim.trace import load_nodes, load_pods

    name, seed, policy, trace_dir = job[:4]
    learned = bool(job[4]) if len(job) > 4 else False
    nodes = load_nodes().gpu_only()
    pods = load_pods(Path(trace_dir) / f"openb_pod_list_{name}.csv")
    if learned:
        r = replay(nodes, pods, policy, seed, learned=True, record=True)
    else:
        r = replay(nodes, pods, policy, seed, workload=target_workload(pods), record=True)
    turned_away = [
        w is None and pods[i].demand.exclusive and pods[i].demand.count > 1
        for i, w in zip(r.order, r.placements, strict=True)
    ]
    large = np.cumsum(turned_away)
    unalloc: dict[str, float | None] = {}
    turned: dict[str, int | None] = {}
    for pct in CHECKS:
        k = int(np.searchsorted(r.arrived_pct, pct - 1e-9))
        unalloc[str(pct)] = None if k >= len(r.arrived_pct) else round(float(100.0 - r.allocated_pct[k]), 4)
        turned[str(pct)] = None if k >= len(r.arrived_pct) else int(large[k])
    return {"list": name, "seed": seed, "policy": policy, "workload": "learned" if learned else "trace",
            "unalloc": unalloc, "large": turned, "seconds": r.seconds}


def _mean(values: list[float | int | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = study_arguments(__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fgd,kubegpu", help="policies (default: fgd,kubegpu)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--cache", type=Path, help="JSON-lines file of finished replays, reused and extended")
    ap.add_argument(
        "--learned",
        action="store_true",
        help="every policy scores with the workload learned online from the pods placed so far, as a running "
        "extender does (default: the pod list's workload, the paper's protocol)",
    )
    args = ap.parse_args(argv)
    mode = "learned" if args.learned else "trace"
    seeds, lists, policies = parse_seeds(args.seeds), args.lists.split(","), args.policies.split(",")
    done: dict[tuple[str, int, str], dict[str, Any]] = {}
    if args.cache and args.cache.exists():
        for line in args.cache.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("workload", "trace") == mode:
                done[(rec["list"], rec["seed"], rec["policy"])] = rec
    missing = [n for n in lists if not (args.traces / f"openb_pod_list_{n}.csv").is_file()]
    if missing:
        ap.error(f"no pod list {', '.join(missing)} under {args.traces} (--traces)")
    todo = [
        (n, s, p, str(args.traces), args.learned)
        for n in lists
        for s in seeds
        for p in policies
        if (n, s, p) not in done
    ]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for i, rec in enumerate(pool.map(one, todo), 1):
            done[(rec["list"], rec["seed"], rec["policy"])] = rec
            if args.cache:
                with args.cache.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            print(
                f"[{i}/{len(todo)}] {rec['list']} seed {rec['seed']} {rec['policy']}: {rec['unalloc']['100']} % at 100",
                file=sys.stderr,
                flush=True,
            )
    out: dict[str, Any] = {"seeds": seeds, "workload": mode, "lists": {}}
    below: dict[str, bool] = {}
    before: dict[str, bool] = {}
    large_ok: dict[str, bool] = {}
    for n in lists:
        per: dict[str, Any] = {}
        for p in policies:
            recs = [done[(n, s, p)] for s in seeds]
            per[p] = {
                "unallocated_pct_at": {c: _mean([r["unalloc"][c] for r in recs]) for c in map(str, CHECKS)},
                "large_turned_away_at": {c: _mean([r["large"][c] for r in recs]) for c in map(str, CHECKS)},
                "seconds": _mean([r["seconds"] for r in recs]),
            }
        out["lists"][n] = per
        if "fgd" in per and "kubegpu" in per:
            k, f = per["kubegpu"], per["fgd"]
            below[n] = k["unallocated_pct_at"]["100"] < f["unallocated_pct_at"]["100"]
            before[n] = all(k["unallocated_pct_at"][c] <= f["unallocated_pct_at"][c] for c in ("80", "90", "95"))
            large_ok[n] = all(k["large_turned_away_at"][c] <= f["large_turned_away_at"][c] for c in map(str, CHECKS))
            print(
                f"{n:12s} at 80/90/95/100: kubegpu "
                + "/".join(f"{k['unallocated_pct_at'][c]:.3f}" for c in map(str, CHECKS))
                + " fgd "
                + "/".join(f"{f['unallocated_pct_at'][c]:.3f}" for c in map(str, CHECKS))
                + f"  large turned away by 100: {k['large_turned_away_at']['100']}"
                + f" (fgd {f['large_turned_away_at']['100']})",
                file=sys.stderr,
            )
    if below:
        out["kubegpu_below_fgd_at_100"] = below
        out["kubegpu_not_worse_than_fgd_before_full"] = before
        out["kubegpu_no_more_large_turned_away"] = large_ok
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
