"""The ``dra`` placement policy: the stock kube-scheduler placing DRA claims, for simulator replays."""

from __future__ import annotations

import numpy as np

from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.engine import choose_gpus, place
from kubegpu.placement.policies import POLICY_NAMES, ScoreContext, get_policy


def _cluster() -> ClusterState:
    # Two 4-GPU nodes: node 0 busy on CPU, node 1 idle.
    st = ClusterState.from_arrays(["busy", "idle"], ["A100", "A100"], [4, 4], [32000, 32000], [2**37, 2**37])
    st.cpu_free[0] = 4000
    st.touch(0)
    return st


def test_registered() -> None:
    assert "dra" in POLICY_NAMES and get_policy("dra").gpu_default == "dra"


def test_node_is_least_allocated_on_cpu_and_memory() -> None:
    st = _cluster()
    d = Demand.share(300, cpu_milli=1000)
    scores = get_policy("dra").node_scores(st, d, np.array([0, 1]), st.gpu_candidates(d)[[0, 1]], ScoreContext())
    assert scores[1] > scores[0]
    got = place(st, d, node_policy="dra")
    assert got is not None and (got.node, got.gpus) == (1, (0,))


def test_devices_first_fit_in_slice_order() -> None:
    st = _cluster()
    ctx = ScoreContext()
    # A share goes to the first GPU with room, even when a fuller one would pack better.
    st.core_free[1, 0] = 200  # GPU 0 has 20 % left
    st.core_free[1, 1] = 500
    st.touch(1)
    assert choose_gpus(st, 1, Demand.share(300), "dra", ctx) == (1,)
    assert choose_gpus(st, 1, Demand.share(100), "dra", ctx) == (0,)
    assert choose_gpus(st, 1, Demand.whole(2), "dra", ctx) == (2, 3)
