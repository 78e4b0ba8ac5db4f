"""Fit of every request kind on one node, readable refusals, and the commit/rollback step."""

from __future__ import annotations

import pytest
from placement_topologies import GIB, dgx1, mig_node, pod, simple_node

from kubegpu.model import parse_pod
from kubegpu.model.allocation import decode, encode
from kubegpu.placement import NodeState, PlacementConflict, fit


def req(*containers: dict[str, str], **kw: object):
    r = parse_pod(pod(*containers, **kw))  # type: ignore[arg-type]
    assert r.ok, r.refusals
    return r


def test_whole_gpus_get_a_quad_and_are_exclusive():
    st = NodeState(dgx1())
    f = fit(st, req({"nvidia.com/gpu": "4"}))
    assert f.ok
    (c,) = f.choice.containers
    assert sorted(g.minor for g in c.grants) in ([0, 1, 2, 3], [4, 5, 6, 7])
    assert all(g.core == 100 and g.memory_ratio == 100 and g.memory_bytes == 16 * GIB for g in c.grants)
    st.apply(f.choice)
    for g in c.grants:
        assert st.core_free(g.uuid) == 0 and st.memory_free(g.uuid) == 0
    # A share cannot land on a whole-held GPU.
    f2 = fit(st, req({"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory": "1Gi"}))
    assert f2.ok and f2.choice.containers[0].grants[0].uuid not in {g.uuid for g in c.grants}


def test_share_reason_names_the_gpu_and_the_numbers():
    st = NodeState(simple_node("n", 1))
    st.apply(fit(st, req({"kubegpu.io/gpu-core": "60", "kubegpu.io/gpu-memory": "2Gi"})).choice)
    f = fit(st, req({"kubegpu.io/gpu-core": "60", "kubegpu.io/gpu-memory": "2Gi"}))
    assert not f.ok
    assert "GPU 0: 40 % compute free, 60 % requested" in f.reason
    assert "'c0'" in f.reason


def test_share_memory_is_a_hard_limit():
    st = NodeState(simple_node("n", 1, memory=16 * GIB))
    st.apply(fit(st, req({"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory": "12Gi"})).choice)
    f = fit(st, req({"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory": "8Gi"}))
    assert not f.ok and "memory free" in f.reason


def test_memory_ratio_converts_to_bytes_of_that_gpu():
    st = NodeState(simple_node("n", 1, memory=16 * GIB))
    f = fit(st, req({"kubegpu.io/gpu": "25"}))
    (g,) = f.choice.containers[0].grants
    assert (g.core, g.memory_ratio, g.memory_bytes) == (25, 25, 4 * GIB)


def test_share_over_k_gpus_uses_k_distinct_gpus():
    st = NodeState(simple_node("n", 4))
    f = fit(st, req({"kubegpu.io/gpu-core": "100", "kubegpu.io/gpu-memory": "8Gi", "kubegpu.io/gpu.shared": "2"}))
    grants = f.choice.containers[0].grants
    assert len({g.uuid for g in grants}) == 2 and all(g.core == 50 and g.memory_bytes == 4 * GIB for g in grants)


def test_best_fit_fills_the_used_gpu_first_without_a_workload():
    st = NodeState(simple_node("n", 2))
    st.apply(fit(st, req({"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory": "1Gi"})).choice)
    f = fit(st, req({"kubegpu.io/gpu-core": "30", "kubegpu.io/gpu-memory": "1Gi"}))
    assert f.choice.containers[0].grants[0].minor == 0


def test_cpu_and_memory_are_hard_limits():
    st = NodeState(simple_node("n", 2, cpu=4000))
    f = fit(st, req({"nvidia.com/gpu": "1"}), cpu_milli=8000)
    assert not f.ok and "8000m CPU requested, 4000m free" in f.reason
    f = fit(st, req({"nvidia.com/gpu": "1"}), memory_bytes=10**15)
    assert not f.ok and "memory requested" in f.reason


def test_model_constraint():
    st = NodeState(simple_node("n", 2, model="T4"))
    f = fit(st, req({"nvidia.com/gpu": "1"}, model="V100M16|V100M32"))
    assert not f.ok and "T4" in f.reason and "V100M16" in f.reason
    assert fit(st, req({"nvidia.com/gpu": "1"}, model="T4|A10")).ok


def test_unhealthy_gpus_are_never_chosen():
    st = NodeState(simple_node("n", 4, unhealthy={0, 2}))
    f = fit(st, req({"nvidia.com/gpu": "2"}))
    assert sorted(g.minor for g in f.choice.containers[0].grants) == [1, 3]
    f = fit(st, req({"nvidia.com/gpu": "3"}))
    assert not f.ok and "GPU 0: unhealthy" in f.reason


def test_mig_devices():
    st = NodeState(mig_node())
    f = fit(st, req({"nvidia.com/mig-1g.10gb": "2"}))
    grants = f.choice.containers[0].grants
    assert [g.mig_uuid for g in grants] == ["MIG-0", "MIG-1"] and all(g.mig_profile == "1g.10gb" for g in grants)
    st.apply(f.choice)
    assert "MIG-0" not in st.mig_free
    assert not fit(st, req({"nvidia.com/mig-1g.10gb": "6"})).ok
    assert not fit(st, req({"nvidia.com/mig-3g.40gb": "1"})).ok
    # The MIG-enabled GPU is not offered whole; the other one is.
    f = fit(st, req({"nvidia.com/gpu": "1"}))
    assert f.choice.containers[0].grants[0].uuid == "GPU-A100-1"
    assert not fit(st, req({"nvidia.com/gpu": "2"})).ok


def test_replicas_need_a_healthy_gpu_and_carry_no_grants():
    assert fit(NodeState(simple_node("n", 1)), req({"nvidia.com/gpu.shared": "2"})).ok
    assert not fit(NodeState(simple_node("n", 1, unhealthy={0})), req({"nvidia.com/gpu.shared": "1"})).ok


def test_containers_do_not_overlap_and_init_containers_are_not_held():
    st = NodeState(simple_node("n", 2))
    r = req({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"}, init=({"nvidia.com/gpu": "2"},))
    f = fit(st, r)
    assert f.ok
    app = [c for c in f.choice.containers if not c.init]
    assert len({g.uuid for c in app for g in c.grants}) == 2
    st.apply(f.choice)
    assert st.core_free("n-GPU-0") == 0 and st.core_free("n-GPU-1") == 0
    st.release(f.choice)
    assert st.core_free("n-GPU-0") == 100


def test_fit_never_mutates_and_apply_is_all_or_nothing():
    st = NodeState(simple_node("n", 2))
    f1 = fit(st, req({"nvidia.com/gpu": "2"}))
    f2 = fit(st, req({"nvidia.com/gpu": "1"}))
    assert st.core_free("n-GPU-0") == 100  # fit did not change anything
    st.apply(f1.choice, cpu_milli=1000)
    before = (st.cpu_free_milli, [st.core_free(u) for u in ("n-GPU-0", "n-GPU-1")])
    with pytest.raises(PlacementConflict):
        st.apply(f2.choice, cpu_milli=1000)  # stale choice: GPU already taken
    assert (st.cpu_free_milli, [st.core_free(u) for u in ("n-GPU-0", "n-GPU-1")]) == before


def test_choice_round_trips_through_the_annotation_and_rebuilds_state():
    inv = dgx1()
    st = NodeState(inv)
    r = req({"kubegpu.io/gpu-core": "30", "kubegpu.io/gpu-memory": "2Gi"}, {"nvidia.com/gpu": "2"})
    f = fit(st, r)
    alloc = decode(encode(f.choice.to_allocation()))
    assert alloc == f.choice.to_allocation()
    st.apply(f.choice, 2000, GIB)
    rebuilt, problems = NodeState.rebuild(inv, [(alloc, 2000, GIB)])
    assert problems == []
    assert [rebuilt.core_free(g.uuid) for g in inv.gpus] == [st.core_free(g.uuid) for g in inv.gpus]
    assert rebuilt.cpu_free_milli == st.cpu_free_milli
    # The same annotation twice over-commits: reported, not crashed, not applied.
    _, problems = NodeState.rebuild(inv, [(alloc, 0, 0), (alloc, 0, 0)])
    assert len(problems) == 1


def test_refused_requests_do_not_fit():
    bad = parse_pod(pod({"kubegpu.io/gpu-core": "50"}))
    f = fit(NodeState(simple_node("n", 1)), bad)
    assert not f.ok and "refused" in f.reason


def test_no_gpu_request_fits_with_an_empty_choice():
    f = fit(NodeState(simple_node("n", 1)), parse_pod({"spec": {"containers": [{"name": "x"}]}}))
    assert f.ok and f.choice.containers == ()
