"""Benchmark: one full replay of the default openb trace (one seed) for bestfit, fgd and kubegpu.

Prints progress lines, then ONE JSON object as the last line:
{"seconds": {"bestfit": s, "fgd": s, "kubegpu": s}, "unallocated_pct_at_100": {...}, "pods": n}
Targets on a 2-core machine: each replay <= 8 s; kubegpu <= 3.5 % and below fgd at arrived 100 %.
Pass ``--all`` to time every registered policy.
"""

from __future__ import annotations

import json
import sys

from kubegpu.sim.replay import replay, target_workload
from kubegpu.sim.trace import load_nodes, load_pods


def main(seed: int = 42, policies: tuple[str, ...] = ("bestfit", "fgd", "kubegpu")) -> dict[str, object]:
    nodes = load_nodes().gpu_only()
    pods = load_pods()
    workload = target_workload(pods)
    seconds: dict[str, float] = {}
    at100: dict[str, float | None] = {}
    n = 0
    for policy in policies:
        r = replay(nodes, pods, policy, seed, workload=workload)
        seconds[policy] = round(r.seconds, 2)
        u = r.unallocated_at(100)
        at100[policy] = None if u is None else round(u, 3)
        n = r.pods
        print(f"{policy}: {r.seconds:.1f} s, unallocated at 100 %: {u:.2f} %", file=sys.stderr, flush=True)
    return {"seconds": seconds, "unallocated_pct_at_100": at100, "pods": n}


if __name__ == "__main__":
    from kubegpu.placement.policies import POLICY_NAMES

    args = [a for a in sys.argv[1:] if a != "--all"]
    chosen = POLICY_NAMES if "--all" in sys.argv[1:] else ("bestfit", "fgd", "kubegpu")
    print(json.dumps(main(int(args[0]) if args else 42, tuple(chosen))))
