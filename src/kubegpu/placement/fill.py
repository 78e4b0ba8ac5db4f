"""How much of a partly used GPU's free compute is likely to stay stranded, given the workload's shares.

FGD (see :mod:`kubegpu.placement.frag`) asks whether a shape fits a GPU at
all, so an 810-milli share on an idle GPU and on a GPU already holding a 160
look alike to it. What strands GPU compute once a cluster fills is the gaps
that later shares rarely fill: on the openb trace about three quarters of the
unallocated GPU at arrived 100 % sit in 190-milli gaps next to 810-milli
shares, which only the rare 50-160 shares can use.

``fill_value(workload)[f]`` is the expected compute a GPU with ``f`` milli
free ends with, under a simple fill model: with probability
``rho(f) = min(1, kappa * P(a one-GPU pod fits in f))`` one more pod of the
workload lands there (drawn by frequency among those that fit) and the GPU
goes on from ``f - size``, otherwise ``f`` stays free. An idle GPU is worth 0
(whole-GPU pods take it). ``kappa`` says how strongly a GPU competes for the
pods that fit it; it was measured on the openb trace (see ``FILL_KAPPA``).

A gap is also stranded when its node has no CPU left for any share that fits
it (``cpu_floor``), so the per-node change of the expected stranded compute
(:func:`fill_delta_per_gpu`) counts every GPU of the node, before and after a
share and its CPU go in.

When the workload's CPU would run out before the cluster's GPUs
(:func:`cpu_pressure` >= 1: the openb lists whose CPU-only pods ask 2.5 times
the default's CPU), whole GPUs end up stranded behind exhausted CPU as well:
then a node's compute that the fill model expects to be used beyond what its
free CPU can feed (at the workload's CPU per GPU) counts as stranded too.
"""

from __future__ import annotations

import numpy as np

from kubegpu.placement.cluster import MILLI, ClusterState, Demand
from kubegpu.placement.ordered import row_sum
from kubegpu.placement.workload import Workload

# How strongly a GPU competes for the pods that fit it. Ranking shares by this measure alone on the default
# openb trace (4 seeds): kappa 15, 20, 30, 50 gave 4.09, 4.03, 4.02, 4.08 % unallocated at arrived 100 %;
# with the CPU floor, 20 and 30 gave 3.91 and 3.94 %. In a pure GPU bin-packing model of the same trace
# (no nodes, 10 seeds) 10, 20, 30, 50, 80 gave 4.01, 3.83, 3.85, 3.90, 4.01 % against best fit's 4.07 %.
FILL_KAPPA = 20.0


def fill_value(workload: Workload, kappa: float = FILL_KAPPA) -> np.ndarray:
    """(MILLI + 1,) expected stranded compute of a GPU with f milli free, by the module's fill model."""
    weight: dict[int, float] = {}
    for shape, freq in zip(workload.every, workload.every_freq, strict=True):
        if shape.count == 1 and shape.milli > 0:
            weight[shape.milli] = weight.get(shape.milli, 0.0) + float(freq)
    value = np.zeros(MILLI + 1)
    total = sum(weight.values())
    if total <= 0:
        value[:MILLI] = np.arange(MILLI)  # nothing ever fills a gap
        return value
    sizes = np.array(sorted(weight), np.int64)
    prob = np.array([weight[s] / total for s in sizes])
    for f in range(1, MILLI):
        fits = sizes <= f
        p = float(prob[fits].sum())
        if p == 0.0:
            value[f] = f
            continue
        rho = min(1.0, kappa * p)
        value[f] = (1.0 - rho) * f + rho * float((prob[fits] / p) @ value[f - sizes[fits]])
    return value


def cpu_floor(workload: Workload) -> np.ndarray:
    """(MILLI + 1,) the least CPU (millicores) of any workload shape one GPU with f milli free could take.

    ``inf`` where nothing fits. Index ``MILLI`` (an idle GPU) also counts whole-GPU shapes.
    """
    floor = np.full(MILLI + 1, np.inf)
    floor[0] = 0.0
    for shape in workload.shapes:
        if shape.count == 1 and 0 < shape.milli < MILLI:
            floor[shape.milli : MILLI] = np.minimum(floor[shape.milli : MILLI], shape.cpu_milli)
        if shape.count >= 1 and shape.milli > 0:
            floor[MILLI] = min(floor[MILLI], shape.cpu_milli)
    return floor


def _asked(workload: Workload, gpu_pods_only: bool) -> tuple[float, float]:
    """(CPU millicores, GPU milli) the workload's pods ask on average, by frequency."""
    cpu = gpu = 0.0
    for shape, freq in zip(workload.every, workload.every_freq, strict=True):
        if gpu_pods_only and not (shape.count > 0 and shape.milli > 0):
            continue
        cpu += float(freq) * shape.cpu_milli
        gpu += float(freq) * shape.count * shape.milli
    return cpu, gpu


def cpu_pressure(cluster: ClusterState, workload: Workload) -> float:
    """CPU the workload asks per GPU it asks, over what the GPU nodes offer per GPU: above 1 their CPU
    runs out before their GPUs (CPU-only pods of the workload included, as they share the nodes)."""
    cpu, gpu = _asked(workload, gpu_pods_only=False)
    gpus = cluster.gpu_ok.sum(axis=1)
    offer_gpu = float(gpus.sum()) * MILLI
    offer_cpu = float(cluster.cpu_cap[gpus > 0].sum())
    if gpu <= 0 or offer_gpu <= 0 or offer_cpu <= 0:
        return 0.0
    return (cpu / gpu) / (offer_cpu / offer_gpu)


def cpu_per_milli(workload: Workload) -> float:
    """CPU (millicores) the workload's GPU pods ask per milli of GPU compute, by frequency."""
    cpu, gpu = _asked(workload, gpu_pods_only=True)
    return cpu / gpu if gpu > 0 else 0.0


def fill_delta_per_gpu(
    cluster: ClusterState,
    rows: np.ndarray,
    demand: Demand,
    candidates: np.ndarray,
    value: np.ndarray,
    floor: np.ndarray,
    feed: float = 0.0,
    feed_weight: float = 1.0,
) -> np.ndarray:
    """(n, G) change of the expected stranded compute of node rows[i] if the one-GPU share went on GPU g.

    A GPU counts ``value[f]``, or all of ``f`` when its node's CPU is below
    ``floor[f]``. With ``feed`` (CPU millicores a milli of GPU compute needs,
    0 = off), of the compute the model expects to be used on a node only what
    its free CPU can feed is; the rest counts as stranded too, ``feed_weight``
    times. Entries where ``candidates`` is False are ``+inf``.
    """
    ok = cluster.gpu_ok[rows]
    free = cluster.usable_free(rows)
    cpu_before = cluster.cpu_free[rows][:, None]
    cpu_after = cpu_before - demand.cpu_milli

    def stranded(f: np.ndarray, cpu: np.ndarray) -> np.ndarray:
        return np.where(ok, np.where(cpu < floor[f], f, value[f]), 0.0)

    # Row sums add the GPUs in order, one elementwise step each (ordered.py): a node's value is the same
    # whatever other nodes are scored with it.
    before_g = stranded(free, cpu_before)
    before = row_sum(before_g)
    others = stranded(free, cpu_after)
    left = np.clip(free - demand.milli, 0, MILLI)
    mine = stranded(left, cpu_after)
    after = (row_sum(others)[:, None] - others) + mine
    if feed > 0:
        # Compute the fill model expects to be used beyond what the node's CPU can feed, before and after.
        usable = np.where(ok, free, 0)
        hungry_before = row_sum(usable - before_g) - cpu_before[:, 0] / feed
        used_others = usable - others
        hungry_after = (
            (row_sum(used_others)[:, None] - used_others) + np.where(ok, left, 0) - mine - cpu_after / feed
        )
        after = after + feed_weight * (np.maximum(hungry_after, 0.0) - np.maximum(hungry_before, 0.0)[:, None])
    return np.where(candidates, after - before[:, None], np.inf)
