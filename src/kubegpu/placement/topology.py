"""NVLink-aware choice of a GPU set on one node (the device plugin's preferred allocation).

Like NVIDIA's go-gpuallocator best-effort policy: every pair of GPUs gets a
score from ONE table of link types (NVLink link counts, same NUMA node over
PCIe, across sockets); a set's quality is the sum of its pair scores. Among the
sets of the requested size that contain the must-include GPUs, the choice
maximises that sum and then, to keep good sets free for later requests,
minimises the link score it cuts from the GPUs left available. Ties go to the
lowest GPU indexes, so the same input always gives the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import IntEnum
from itertools import combinations
from math import comb
from typing import Final

from kubegpu.model.inventory import Gpu


class LinkType(IntEnum):
    """How two GPUs talk; the value is never used as a score (see :data:`LINK_SCORES`)."""

    CROSS_SOCKET = 0  # PCIe through the inter-socket link (or topology unknown)
    SAME_NUMA = 1  # PCIe under one socket
    NVLINK = 2  # one or more NVLink links


# The one table of pair scores. NVLink scores per link so a 2-link pair beats a 1-link pair,
# and any NVLink pair beats any PCIe pair.
LINK_SCORES: Final[Mapping[LinkType, int]] = {
    LinkType.CROSS_SOCKET: 10,
    LinkType.SAME_NUMA: 20,
    LinkType.NVLINK: 100,  # per link
}

# Above this many candidate sets the exact search gives way to a greedy one (still deterministic).
MAX_EXACT_SETS: Final = 5000


class GpuSetError(ValueError):
    """The request cannot be answered (unknown IDs, size out of range, must-include not available)."""


def link_type(a: Gpu, b: Gpu) -> tuple[LinkType, int]:
    """The link type between two GPUs and its NVLink link count (0 for PCIe)."""
    links = max(a.links.get(b.uuid, 0), b.links.get(a.uuid, 0))
    if links > 0:
        return LinkType.NVLINK, links
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return LinkType.SAME_NUMA, 0
    return LinkType.CROSS_SOCKET, 0


def pair_score(a: Gpu, b: Gpu) -> int:
    """Score of one GPU pair from :data:`LINK_SCORES`."""
    kind, links = link_type(a, b)
    if kind is LinkType.NVLINK:
        return LINK_SCORES[kind] * links
    return LINK_SCORES[kind]


def score_matrix(gpus: Sequence[Gpu]) -> list[list[int]]:
    """Pair scores by position in ``gpus`` (0 on the diagonal)."""
    n = len(gpus)
    return [[pair_score(gpus[i], gpus[j]) if i != j else 0 for j in range(n)] for i in range(n)]


def set_score(gpus: Sequence[Gpu], uuids: Sequence[str]) -> int:
    """Sum of pair scores inside a set of GPUs given by UUID."""
    by_uuid = {g.uuid: g for g in gpus}
    chosen = [by_uuid[u] for u in uuids]
    return sum(pair_score(a, b) for a, b in combinations(chosen, 2))


def choose_gpu_set(gpus: Sequence[Gpu], available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The best ``size`` GPUs (UUIDs, in index order) among ``available``, containing ``must_include``.

    ``gpus`` is the node's inventory (for indexes and links). Unknown or
    unavailable IDs raise :class:`GpuSetError`; so does a size larger than the
    available set. Deterministic: the same arguments always give the same list.
    """
    by_uuid = {g.uuid: g for g in gpus}
    avail_ids = list(dict.fromkeys(available))
    unknown = [u for u in [*avail_ids, *must_include] if u not in by_uuid]
    if unknown:
        raise GpuSetError(f"unknown GPU IDs: {', '.join(sorted(set(unknown)))}")
    must = list(dict.fromkeys(must_include))
    missing = [u for u in must if u not in avail_ids]
    if missing:
        raise GpuSetError(f"must-include GPUs not available: {', '.join(missing)}")
    if size < len(must):
        raise GpuSetError(f"size {size} is smaller than the {len(must)} must-include GPUs")
    if size > len(avail_ids):
        raise GpuSetError(f"size {size} is larger than the {len(avail_ids)} available GPUs")
    if size == 0:
        return []

    pool = sorted((by_uuid[u] for u in avail_ids), key=lambda g: (g.index, g.uuid))
    pos = {g.uuid: i for i, g in enumerate(pool)}
    best = best_set(score_matrix(pool), list(range(len(pool))), [pos[u] for u in must], size)
    return [pool[i].uuid for i in best]


def best_set(
    scores: Sequence[Sequence[int]], available: Sequence[int], must: Sequence[int], size: int
) -> tuple[int, ...]:
    """The best ``size`` positions of a pair-score matrix among ``available``, containing ``must``.

    Maximises the pair scores inside the set, then minimises the score cut
    from the rest of ``available``, then prefers the lowest positions.
    Positions are returned sorted. The caller checks sizes.
    """
    avail = sorted(set(available))
    fixed = tuple(sorted(set(must)))
    free = [i for i in avail if i not in fixed]
    need = size - len(fixed)
    if need <= 0:
        return fixed

    def key(chosen: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        inside = sum(scores[a][b] for a, b in combinations(chosen, 2))
        cut = sum(scores[a][b] for a in chosen for b in avail if b not in chosen)
        # Max inside, then min cut, then lowest positions: negate for min().
        return (-inside, cut, chosen)

    if comb(len(free), need) <= MAX_EXACT_SETS:
        return min((tuple(sorted(fixed + extra)) for extra in combinations(free, need)), key=key)
    return _greedy(scores, fixed, free, need)


def _greedy(scores: Sequence[Sequence[int]], fixed: tuple[int, ...], free: list[int], need: int) -> tuple[int, ...]:
    """Grow the set one GPU at a time: most links into the set, then fewest to the rest, then index."""
    chosen = list(fixed)
    left = list(free)
    if not chosen:
        # Seed with the strongest pair (or the least connected GPU for a single GPU).
        if need >= 2:
            a, b = min(combinations(left, 2), key=lambda p: (-scores[p[0]][p[1]], p))
            chosen, need = [a, b], need - 2
            left = [i for i in left if i not in (a, b)]
        else:
            g = min(left, key=lambda i: (sum(scores[i][j] for j in left), i))
            return (g,)
    for _ in range(need):

        def gain(i: int) -> tuple[int, int, int]:
            into = sum(scores[i][c] for c in chosen)
            out = sum(scores[i][j] for j in left if j != i)
            return (-into, out, i)

        g = min(left, key=gain)
        chosen.append(g)
        left.remove(g)
    return tuple(sorted(chosen))
