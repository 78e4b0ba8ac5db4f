"""Sums whose value for one node never depends on which other nodes are computed with it.

The extender scores the nodes kube-scheduler sends, in the order it sends them (its filter runs in
parallel and starts where the last pod's stopped), and keeps per-row scores across calls; the
simulator scores every feasible node in index order. For both to pick the same node, a node's score
must be the same bits whatever batch it is computed in. A BLAS product or a numpy reduction over a
non-contiguous axis does not promise that: the order in which it adds the terms of one output depends
on the shape of the whole operand (blocking, vector tails, a single column taking the pairwise path),
and FGD's truncated scores turn a last-bit difference into a whole point.

Two ways are used, each correct by construction:

- integer-valued terms (``exact_dot``): every product and partial sum is an integer below 2**53, so
  float addition is exact and any order gives the same value;
- other float terms (``weighted_sum``, ``row_sum``): one elementwise step per term, in a fixed order,
  so each element sees the same IEEE operations whatever the batch.
"""

from __future__ import annotations

import numpy as np

# Every exact sum must stay below this (2**53, float64's integer range), with room for a few terms more.
EXACT_LIMIT = float(2**50)


def exact_dot(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``weight @ x`` over the first axis, for integer-valued ``weight`` (T,) and integer ``x`` (T, ...) whose
    weighted sums stay below :data:`EXACT_LIMIT`: exact, hence the same bits in any batch and order."""
    flat = np.asarray(x, np.float64).reshape(len(weight), int(np.prod(x.shape[1:], dtype=np.int64)))
    return np.asarray(weight @ flat).reshape(x.shape[1:])


def weighted_sum(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """sum_t weight[t] * x[t] over the first axis, adding the terms in t order, one elementwise step each."""
    out = np.zeros(x.shape[1:], np.float64)
    for t in range(len(weight)):
        out += weight[t] * x[t]
    return out


def row_sum(x: np.ndarray) -> np.ndarray:
    """The sum over the last axis of a float array, adding its columns in order, one elementwise step each."""
    if x.shape[-1] == 0:
        return np.zeros(x.shape[:-1], np.float64)
    out = np.array(x[..., 0], np.float64)
    for g in range(1, x.shape[-1]):
        out += x[..., g]
    return out
