"""How little GPU a perfect offline packer would strand: a floor under every placement policy's result.

A replay's unallocated GPU at arrived 100 % is the compute left free between
the shares on partly used GPUs (whole GPUs tile perfectly). If every share
that arrived is placed, no policy, online or offline, can leave less than the
least waste of packing those shares into GPUs: a bin-packing problem, solved
here exactly as a cutting-stock integer programme over the packing patterns
(:func:`share_packing_floor`). It relaxes everything else a real placement
must respect (CPU, memory, GPU models, which node a GPU is on), so it is a
true floor: a policy can only get below it by having shares turned away.

Used by ``bench/packing_bound.py`` and the simulator's documentation to say how
far kubegpu's placement is from the best possible; needs ``scipy`` (the
``sim`` extra), imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import MILLI

# Enumerating packing patterns is exponential in the number of small sizes; refuse rather than hang. The
# paper's openb lists need about 10,000 steps and 2,000 patterns.
MAX_PATTERNS = 200_000
MAX_STEPS = 2_000_000


@dataclass(frozen=True, slots=True)
class PackingFloor:
    """The least number of GPUs that hold the shares, and what they then leave free."""

    gpus: float  # least number of GPUs (a proven lower bound; equal to the optimum when ``optimal``)
    share_milli: int  # compute the shares ask for in all
    patterns: int  # maximal packing patterns considered
    optimal: bool  # the solver proved ``gpus`` optimal (else it is its best lower bound)

    @property
    def waste_milli(self) -> float:
        """Compute left free on the GPUs the shares occupy, at best."""
        return self.gpus * MILLI - self.share_milli

    def waste_pct(self, capacity_milli: int) -> float:
        """The floor as a % of a cluster's GPU capacity (the unit of the replay's unallocated GPU)."""
        return 100.0 * self.waste_milli / capacity_milli


def packing_patterns(counts: Mapping[int, int], size: int = MILLI) -> np.ndarray:
    """(S, P) the maximal ways to fill one GPU: how many of each size (sorted descending) one pattern holds.

    A pattern is maximal when no share still available would fit beside it;
    only those can be needed for a least-GPU packing of all shares.
    """
    if any(s <= 0 or s > size for s, n in counts.items() if n > 0):
        raise ValueError(f"share sizes must lie in 1..{size} milli")
    sizes = sorted((s for s, n in counts.items() if n > 0), reverse=True)
    out: list[list[int]] = []
    steps = 0

    def extend(i: int, left: int, taken: list[int]) -> None:
        nonlocal steps
        steps += 1
        if len(out) > MAX_PATTERNS or steps > MAX_STEPS:
            raise ValueError(
                f"more than {MAX_PATTERNS} packing patterns or {MAX_STEPS} steps: too many small share sizes"
            )
        if i == len(sizes):
            # Maximal: no size with shares left over (beyond what this pattern took) would still fit.
            if any(taken) and not any(sizes[j] <= left and taken[j] < counts[sizes[j]] for j in range(len(sizes))):
                out.append(list(taken))
            return
        for k in range(min(left // sizes[i], counts[sizes[i]]), -1, -1):
            taken.append(k)
            extend(i + 1, left - k * sizes[i], taken)
            taken.pop()

    extend(0, size, [])
    return np.array(out, np.int64).T.reshape(len(sizes), len(out))


def share_packing_floor(counts: Mapping[int, int], time_limit_s: float = 60.0) -> PackingFloor:
    """The least GPUs that hold ``counts`` (share milli -> how many), each GPU holding at most 1000 milli."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    counts = {int(s): int(n) for s, n in counts.items() if n > 0}
    share_milli = sum(s * n for s, n in counts.items())
    if not counts:
        return PackingFloor(0.0, 0, 0, True)
    a = packing_patterns(counts)
    need = np.array([counts[s] for s in sorted(counts, reverse=True)], np.float64)
    res = milp(
        c=np.ones(a.shape[1]),
        constraints=LinearConstraint(a.astype(np.float64), lb=need, ub=np.inf),
        integrality=np.ones(a.shape[1]),
        bounds=Bounds(0, np.inf),
        options={"time_limit": time_limit_s},
    )
    if res.status == 0:
        return PackingFloor(float(round(res.fun)), share_milli, a.shape[1], True)
    bound = getattr(res, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        raise RuntimeError(f"the packing programme was not solved: {res.message}")
    # Whole GPUs: a fractional lower bound on a count rounds up.
    return PackingFloor(float(np.ceil(bound - 1e-9)), share_milli, a.shape[1], False)
