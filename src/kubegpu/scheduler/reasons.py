"""Why a node cannot take a demand, in words a person reads in kube-scheduler's FailedScheduling event.

kube-scheduler puts each reason into an Event message through a printf-style format, and prefixes it with
the number of nodes that gave it ("0/3 nodes are available: 2 <reason>."). So a reason never holds ``%``
(``50 % compute`` became ``50 %!c(MISSING)ompute``) and starts with words, not a number ("1 1 whole
GPU(s)"). :func:`readable` enforces both on every reason the extender sends, whoever wrote it.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from kubegpu.placement import ClusterState, Demand
from kubegpu.placement.policies import RowCache


def insufficient(cluster: ClusterState, rows: np.ndarray, demand: Demand,
                 candidates: np.ndarray | None = None) -> list[str]:
    """Readable reasons for nodes that cannot take ``demand``, from the arrays. Nodes in the same
    situation get the same text (kube-scheduler's event then counts them together), so each distinct
    situation is worded once: rows are reduced to an integer code, and only unique codes are formatted.
    A row's text depends on that row's arrays and the demand alone. ``candidates``: the cluster's
    ``gpu_candidates(demand)`` when the caller has it."""
    n = len(rows)
    idx = np.arange(n)
    ok = cluster.gpu_ok[rows]
    core = np.where(ok, cluster.core_free[rows], -1).astype(np.int64)
    cand = cluster.gpu_candidates(demand) if candidates is None else candidates
    n_cand = cand[rows].sum(axis=1).astype(np.int64)
    n_ok = ok.sum(axis=1).astype(np.int64)
    best = core.argmax(axis=1)
    best_pct = np.maximum(core[idx, best], 0) // 10
    zeros = np.zeros(n, np.int64)
    mem_best = mem_free = mem_need = zeros
    if demand.exclusive:  # 0 no usable GPU, 1 whole GPUs short
        case = np.where(n_ok == 0, 0, 1)
    elif demand.count > 1:  # 2 too few GPUs with room, 3 compute short
        case = np.where(n_ok == 0, 0, np.where(n_cand > 0, 2, 3))
    else:  # 3 compute short, 4 memory short (there is compute, but no GPU with it has the memory)
        roomy = core >= demand.milli
        case = np.where(n_ok == 0, 0, np.where(roomy.any(axis=1), 4, 3))
        mem = np.where(roomy, cluster.gmem_free[rows], -1)
        mem_best = mem.argmax(axis=1)
        tenth_gib = 2**30 // 10
        mem_free = np.maximum(mem[idx, mem_best], 0) // tenth_gib
        mem_need = cluster.gpu_memory_need(demand)[rows][idx, mem_best] // tenth_gib
    param = np.select(
        [case == 1, case == 2, case == 3, case == 4],
        [(n_cand << 24) | (n_ok << 16) | (best << 8) | best_pct, n_cand, (best << 8) | best_pct,
         (mem_best << 40) | (mem_free << 20) | mem_need], 0)
    codes = (case.astype(np.int64) << 56) | param
    uniq, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    want = demand.milli // 10
    texts = []
    for k in first.tolist():
        c = int(case[k])
        if c == 0:
            texts.append("no healthy GPU available to share (all unhealthy or MIG-enabled)")
        elif c == 1:
            texts.append(f"not enough free whole GPUs: {demand.count} requested, "
                         f"{n_cand[k]} of {n_ok[k]} free (GPU {best[k]} has {best_pct[k]} percent compute free)")
        elif c == 2:
            texts.append(f"too few GPUs with room: {demand.count} GPUs with {want} percent compute each "
                         f"requested, {n_cand[k]} have it")
        elif c == 3:
            texts.append(f"not enough GPU compute: GPU {best[k]} has {best_pct[k]} percent free, "
                         f"{want} percent requested")
        else:
            texts.append(f"not enough GPU memory: GPU {mem_best[k]} has {mem_free[k] / 10:.1f} GiB free, "
                         f"{mem_need[k] / 10:.1f} GiB requested")
    assert len(texts) == len(uniq)
    return np.asarray(texts, dtype=object)[inverse.reshape(-1)].tolist()


class ReasonCache:
    """Per-row :func:`insufficient` texts per demand, kept with the row version they were worded at
    (a :class:`~kubegpu.placement.policies.RowCache` of texts): a filter pays only for the rows changed
    since the last filter with the same demand, not for thousands of nodes. At most ``limit`` demands are
    kept, least recently used dropped."""

    def __init__(self, limit: int = 64) -> None:
        self._rows = RowCache(limit, dtype=object)

    def clear(self) -> None:
        self._rows.clear()

    def insufficient(self, cluster: ClusterState, rows: np.ndarray, demand: Demand,
                     candidates: np.ndarray | None = None) -> list[str]:
        """:func:`insufficient` of ``rows`` (same texts), worded only where a row changed."""

        def word(pos: np.ndarray) -> np.ndarray:
            return np.asarray(insufficient(cluster, rows[pos], demand, candidates), dtype=object)

        out: list[str] = self._rows.get(demand, cluster, rows, word).tolist()
        return out


_PERCENT = re.compile(r"\s*%")
_PLURAL = re.compile(r"\b(GPU|device|container)\(s\)")


@functools.lru_cache(maxsize=4096)  # nodes in the same situation share a text: a filter rewords few
def readable(reason: str) -> str:
    """A reason as kube-scheduler's Event shows it well: no ``%`` (it is a format string there), no ``(s)``
    plurals, and a leading word (the Event puts a node count in front)."""
    if "%" not in reason and "(s)" not in reason and not reason[:1].isdigit():
        return reason  # already readable (most are): no regex, whatever the cache holds
    text = _PERCENT.sub(" percent", reason)
    text = _PLURAL.sub(r"\1s", text)
    if text[:1].isdigit():
        text = "not enough GPUs: " + text
    return text
