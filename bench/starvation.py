"""Benchmark: do wide pods (4 and 8 whole GPUs) starve behind small ones, with and without reservations?

Two workloads through the queued replay (src/kubegpu/sim/queue.py, the same pure reservation core the extender
calls): the stand-in for the recorded churn (10 nodes x 8 A100, 400 pods at 1.7 pods/s living 20-90 s, a pod
not placed within 120 s withdrawn; pods declare their run time, so short ones may backfill held GPUs), and the
openb default list replayed in time with departures (every pod, or the first ``--openb-pods`` by creation;
arrivals compressed to the load that brings the peak request to 95 % of the GPUs). ``bench/starvation_extender.py``
runs the same churn through the extender's HTTP verbs.

The recorded churn asks for about 1.8 times the cluster's GPUs while it arrives (its wide pods alone about 0.9
times), so pods must be withdrawn whatever the policy: reservations choose that it is not the wide ones. The same
pods are also replayed arriving slower (``--loads``, default 1.2 and 1.0 times the GPUs), where every pod can run.

Prints one line per run, then ONE JSON object as the last line: wide_pods_never_placed (target 0),
wide_wait_p99_s, small_wait_p99_s, small_pods_never_placed, the same ``_without`` reservations, idle_gpu_cost_pct
(target <= 1: held GPUs left free while a pod that would have fit there waited, % of the GPU capacity of the run),
all over the recorded churn and openb; ``churn_at_load`` the same for the churn at each lighter load; and each
run's details (per width; ``gave_up``: withdrawn after 120 s, the rest of the never placed still waited when the
replay ended; ``gpu_used_pct``: the GPU capacity in use). ``--draws N`` adds ``churn_draws``: the churn's own draw
and N others at every load, each draw's headline keys and their worst and median, since one draw's numbers move
a lot with any change that moves one pod. ``--openb-pods 0`` replays the churn alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np

from kubegpu.placement.reservations import ReservationConfig
from kubegpu.sim.churn import Churn
from kubegpu.sim.queue import QueueResult, replay_queue, trace_queue
from kubegpu.sim.replay import target_workload
from kubegpu.sim.timeline import load_for_peak
from kubegpu.sim.trace import load_nodes, load_pods

WIDE = ("4", "8")
SMALL = ("share", "1", "2")


def _line(name: str, r: QueueResult) -> None:
    wide, small = r.stats(WIDE), r.stats(SMALL)
    print(f"{name}, reservations {'on' if r.reservations else 'off'}: wide never placed {wide.never_placed}, "
          f"wide p99 {wide.wait_p99_s:.1f} s, small p99 {small.wait_p99_s:.1f} s, small never placed "
          f"{small.never_placed} (all widths: {sum(r.never_placed.values())} never placed, {sum(r.gave_up.values())} "
          f"of them withdrawn), GPUs in use {r.used_pct:.0f} %, idle cost {r.idle_gpu_cost_pct:.2f} % (held idle "
          f"{r.held_idle_pct:.2f} %), {r.seconds:.1f} s", file=sys.stderr, flush=True)


def _churn(churn: Churn, config: ReservationConfig, name: str) -> dict[str, QueueResult]:
    out = {}
    for label, cfg in (("without", None), ("with", config)):
        out[label] = replay_queue(churn.cluster(), churn.pods(), reservations=cfg, declared_runtime=True,
                                  give_up_s=churn.give_up_s)
        _line(name, out[label])
    return out


def _summary(runs: dict[str, dict[str, QueueResult]]) -> dict[str, float]:
    """The headline keys over these runs: counts summed, waits and the idle cost at their worst."""

    def worst(label: str, widths: tuple[str, ...], field: str) -> float:
        return round(max(float(getattr(r[label].stats(widths), field)) for r in runs.values()), 3)

    def never(label: str, widths: tuple[str, ...]) -> int:
        return sum(r[label].stats(widths).never_placed for r in runs.values())

    return {
        "wide_pods_never_placed": never("with", WIDE),
        "wide_wait_p99_s": worst("with", WIDE, "wait_p99_s"),
        "small_wait_p99_s": worst("with", SMALL, "wait_p99_s"),
        "small_pods_never_placed": never("with", SMALL),
        "wide_pods_never_placed_without": never("without", WIDE),
        "wide_wait_p99_s_without": worst("without", WIDE, "wait_p99_s"),
        "small_wait_p99_s_without": worst("without", SMALL, "wait_p99_s"),
        "small_pods_never_placed_without": never("without", SMALL),
        "idle_gpu_cost_pct": round(max(r["with"].idle_gpu_cost_pct for r in runs.values()), 3),
    }


def _draw(churn: Churn, config: ReservationConfig, load: float | None) -> dict[str, float]:
    """One draw of the churn at one load, with and without reservations: what the robustness table lists."""
    at = churn if load is None else churn.at_load(load)
    by = {label: replay_queue(at.cluster(), at.pods(), reservations=cfg, declared_runtime=True,
                              give_up_s=at.give_up_s) for label, cfg in (("without", None), ("with", config))}
    return {"seed": churn.seed, **_summary({"churn": by})}


def _draws(churn: Churn, config: ReservationConfig, loads: tuple[float, ...], draws: int) -> dict[str, object]:
    """The churn's own draw and ``draws`` others (the next seeds) at the recorded load and each lighter one: per
    load every draw's headline keys, the wide pods never placed summed, the idle cost's and the small pods' p99
    at their worst and median. One draw's numbers move with any change that moves one pod (arrivals a fraction
    of a second apart order the queue), so a policy is judged over several."""
    seeds = [churn.seed + k for k in range(draws + 1)]
    out: dict[str, object] = {}
    for load in (None, *loads):
        rows = [_draw(replace(churn, seed=seed), config, load) for seed in seeds]
        print(f"churn draws at {'the recorded load' if load is None else f'{load:g}x'}: " + ", ".join(
            f"{r['seed']}: wide {r['wide_pods_never_placed']}, idle {r['idle_gpu_cost_pct']} %" for r in rows),
            file=sys.stderr, flush=True)

        def spread(key: str, rows: list[dict[str, float]] = rows) -> dict[str, float]:
            values = np.asarray([r[key] for r in rows])
            return {"max": round(float(values.max()), 3), "median": round(float(np.median(values)), 3)}

        out["recorded" if load is None else f"{load:g}"] = {
            "wide_pods_never_placed": int(sum(r["wide_pods_never_placed"] for r in rows)),
            "wide_pods_never_placed_without": int(sum(r["wide_pods_never_placed_without"] for r in rows)),
            "idle_gpu_cost_pct": spread("idle_gpu_cost_pct"),
            "small_wait_p99_s": spread("small_wait_p99_s"),
            "small_wait_p99_s_without": spread("small_wait_p99_s_without"),
            "draws": rows,
        }
    return out


def main(openb_pods: int | None, config: ReservationConfig, loads: tuple[float, ...] = (),
         seed: int | None = None, draws: int = 0) -> dict[str, object]:
    churn = Churn() if seed is None else Churn(seed=seed)
    runs: dict[str, dict[str, QueueResult]] = {"churn": _churn(churn, config, "churn")}
    lighter = {f"{load:g}": _churn(churn.at_load(load), config, f"churn at {load:g}x") for load in loads}
    if openb_pods != 0:
        nodes = load_nodes().gpu_only()
        pods = sorted((p for p in load_pods() if p.creation >= 0), key=lambda p: p.creation)[:openb_pods]
        queued = trace_queue(pods, load_for_peak(pods, nodes.total_gpus * 1000))
        workload = target_workload(pods)
        runs["openb"] = {}
        for label, cfg in (("without", None), ("with", config)):
            runs["openb"][label] = replay_queue(nodes.cluster(), queued, reservations=cfg, workload=workload)
            _line("openb", runs["openb"][label])

    return {
        **_summary(runs),
        "churn_offered_load": round(churn.offered_load, 2),
        "churn_seed": churn.seed,
        "churn_at_load": {load: _summary({"churn": by}) for load, by in lighter.items()},
        **({"churn_draws": _draws(churn, config, loads, draws)} if draws else {}),
        "reservation": {"min_gpus": config.min_gpus, "wait_seconds": config.wait_seconds,
                        "max_share": config.max_share},
        "runs": {name: {label: r.to_json() for label, r in by.items()}
                 for name, by in {**runs, **{f"churn_at_{k}": v for k, v in lighter.items()}}.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--openb-pods", type=int, default=None,
                        help="only the first pods of the openb default list (0: the churn alone)")
    parser.add_argument("--wait", type=float, default=5.0, help="reservation threshold, seconds")
    parser.add_argument("--max-share", type=float, default=0.5, help="reservation budget, fraction of the GPUs")
    parser.add_argument("--min-gpus", type=int, default=4)
    parser.add_argument("--loads", type=float, nargs="*", default=[1.2, 1.0],
                        help="also replay the churn arriving at these multiples of the cluster's GPUs")
    parser.add_argument("--seed", type=int, default=None, help="another draw of the churn's pods (default: its own)")
    parser.add_argument("--draws", type=int, default=0,
                        help="also replay this many other draws of the churn (the next seeds) at every load and "
                             "report them as churn_draws: worst and median over the draws")
    a = parser.parse_args()
    if a.draws < 0:
        parser.error("--draws must be 0 or more")
    print(json.dumps(main(a.openb_pods, ReservationConfig(a.min_gpus, a.wait, a.max_share), tuple(a.loads),
                          a.seed, a.draws)))
