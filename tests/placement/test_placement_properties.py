"""Property tests of the placement invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_topologies import GIB, pod

from kubegpu.model import Gpu, NodeInventory, parse_pod
from kubegpu.placement import ClusterState, Demand, NodeState, ScoreContext, Workload, fit, place
from kubegpu.placement.policies import POLICY_NAMES

MODELS = ("T4", "V100M16", "A10")


@st.composite
def nodes(draw: st.DrawFn) -> NodeInventory:
    n = draw(st.integers(1, 8))
    model = draw(st.sampled_from(MODELS))
    unhealthy = draw(st.sets(st.integers(0, n - 1), max_size=n))
    gpus = tuple(Gpu(f"GPU-{i}", i, i, model, 16 * GIB, healthy=i not in unhealthy, numa_node=i // 4) for i in range(n))
    return NodeInventory("n", gpus, cpu_milli=draw(st.integers(0, 64_000)), memory_bytes=256 * GIB)


@st.composite
def requests(draw: st.DrawFn) -> tuple[dict, int, int]:
    kind = draw(st.sampled_from(["whole", "share", "multi-share"]))
    if kind == "whole":
        limits = {"nvidia.com/gpu": str(draw(st.integers(1, 4)))}
    elif kind == "share":
        limits = {
            "kubegpu.io/gpu-core": str(draw(st.integers(1, 100))),
            "kubegpu.io/gpu-memory": f"{draw(st.integers(1, 16))}Gi",
        }
    else:
        k = draw(st.integers(1, 3))
        limits = {
            "kubegpu.io/gpu-core": str(k * draw(st.integers(1, 100 // k))),
            "kubegpu.io/gpu-memory": f"{k * draw(st.integers(1, 8))}Gi",
            "kubegpu.io/gpu.shared": str(k),
        }
    model = draw(st.none() | st.sampled_from(["T4", "T4|A10", "V100M16"]))
    return pod(limits, model=model), draw(st.integers(0, 8000)), draw(st.integers(0, 8)) * GIB


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(), st.lists(requests(), min_size=1, max_size=12))
def test_fit_and_commit_keep_every_invariant(inv: NodeInventory, reqs: list[tuple[dict, int, int]]) -> None:
    state = NodeState(inv)
    for spec, cpu, mem in reqs:
        r = parse_pod(spec)
        assert r.ok
        a = fit(state, r, cpu, mem)
        b = fit(state, r, cpu, mem)
        assert a == b  # same input, same choice
        if not a.ok:
            assert a.reason
            continue
        grants = [g for c in a.choice.containers for g in c.grants]
        by_uuid = {g.uuid: g for g in inv.gpus}
        for g in grants:
            gpu = by_uuid[g.uuid]
            assert gpu.healthy  # never an unhealthy GPU
            if r.allowed_models is not None:
                assert gpu.model in r.allowed_models  # never a disallowed model
        for c in a.choice.containers:
            assert len({g.uuid for g in c.grants}) == len(c.grants)  # k distinct GPUs
        state.apply(a.choice, cpu, mem)
    # After every commit: no GPU above 100 % compute or its memory, CPU and memory never negative.
    for g in inv.gpus:
        assert 0 <= state.core_free(g.uuid) <= 100
        assert 0 <= state.memory_free(g.uuid) <= g.memory_bytes
    assert state.cpu_free_milli >= 0 and state.memory_free_bytes >= 0


@settings(max_examples=60, deadline=None)
@given(nodes(), st.integers(1, 4))
def test_whole_gpus_are_exclusive(inv: NodeInventory, n: int) -> None:
    state = NodeState(inv)
    held: set[str] = set()
    for _ in range(3):
        a = fit(state, parse_pod(pod({"nvidia.com/gpu": str(n)})))
        if not a.ok:
            break
        ids = {g.uuid for g in a.choice.containers[0].grants}
        assert not ids & held
        held |= ids
        state.apply(a.choice)
        # No share can land on a whole-held GPU.
        s = fit(state, parse_pod(pod({"kubegpu.io/gpu-core": "1", "kubegpu.io/gpu-memory": "1Mi"})))
        if s.ok:
            assert s.choice.containers[0].grants[0].uuid not in held


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    n = draw(st.integers(1, 12))
    counts = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=n, max_size=n))
    models = draw(st.lists(st.sampled_from(MODELS), min_size=n, max_size=n))
    cpus = draw(st.lists(st.integers(1000, 96_000), min_size=n, max_size=n))
    return ClusterState.from_arrays([f"n{i}" for i in range(n)], models, counts, cpus, [256 * GIB] * n)


demands = st.builds(
    lambda kind, k, milli, cpu, models: (
        Demand.whole(k, cpu, GIB, models)
        if kind == "whole"
        else Demand(1, milli, 0, 0, False, cpu, GIB, models)
        if kind == "share"
        else Demand(0, 0, 0, 0, False, cpu, GIB, None)
    ),
    st.sampled_from(["whole", "share", "cpu"]),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(10, 990),
    st.integers(0, 16_000),
    st.none() | st.just(frozenset({"T4"})) | st.just(frozenset({"A10", "V100M16"})),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(demands, min_size=1, max_size=40), st.sampled_from(POLICY_NAMES))
def test_cluster_placement_invariants_for_every_policy(cl: ClusterState, ds: list[Demand], policy: str) -> None:
    wl = Workload.from_demands(ds)
    ctx = ScoreContext(workload=wl, rng=np.random.default_rng(0))
    for d in ds:
        p = place(cl, d, policy, None, ctx)
        if p is None:
            assert not cl.feasible(d).any()
            continue
        assert len(p.gpus) == d.count and len(set(p.gpus)) == d.count  # one node, k distinct GPUs
        if d.models is not None:
            assert cl.model_of(p.node) in d.models
        cl.take(p.node, p.gpus, d)
        assert (cl.core_free >= 0).all() and (cl.core_free <= 1000).all()
        assert (cl.cpu_free >= 0).all() and (cl.mem_free >= 0).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(demands, min_size=1, max_size=25), st.sampled_from(POLICY_NAMES))
def test_same_input_same_choice(cl: ClusterState, ds: list[Demand], policy: str) -> None:
    wl = Workload.from_demands(ds)
    a, b = cl.copy(), cl.copy()
    ca = ScoreContext(workload=wl, rng=np.random.default_rng(7))
    cb = ScoreContext(workload=wl, rng=np.random.default_rng(7))
    for d in ds:
        pa, pb = place(a, d, policy, None, ca), place(b, d, policy, None, cb)
        assert pa == pb
        if pa is not None:
            a.take(pa.node, pa.gpus, d)
            b.take(pb.node, pb.gpus, d)
