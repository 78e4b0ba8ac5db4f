"""Issue 12 items 1, 2 and 6: what one extender request may cost, and what bind believes.

* a pod with more GPU containers than the cap is refused by filter (every node unresolvable, with the
  reason), scored 0 by prioritize and refused by bind;
* the aggregate prefilter rules a node out before any per-node fit;
* the time budget stops the per-node fits with a reason on each node not reached;
* a large filter gives the event loop back, so a 1-GPU pod's filter is answered while it runs;
* bind records what the API server's pod asks for, whatever an earlier /filter body said;
* the view's per-model mask cache stays bounded.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
from sched_harness import plan_of

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import annotations as A
from kubegpu.model.allocation import decode
from kubegpu.model.inventory import NodeInventory
from kubegpu.scheduler import limits as L
from kubegpu.scheduler import verbs
from kubegpu.scheduler.app import Extender
from kubegpu.scheduler.limits import Limits, bounded_filter, too_many_gpu_containers
from kubegpu.scheduler.mirror import MAX_MODEL_MASKS
from kubegpu.scheduler.state import ClusterView


def inventories(n: int, model: str = "dgx-a100") -> list[NodeInventory]:
    base = FakeBackend(model, node_name="n0").discover()
    return [replace(base, name=f"n{i}") for i in range(n)]


def view_of(n: int) -> ClusterView:
    view = ClusterView(handoff_wait=False)
    for inv in inventories(n):
        view.set_inventory(inv.name, inv)
    return view


def pod(containers: list[dict[str, str]], uid: str = "u1", name: str = "p", **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": uid, **meta},
            "spec": {"containers": [{"name": f"c{i}", "image": "x", "resources": {"limits": lim}}
                                    for i, lim in enumerate(containers)]}}


def filter_body(p: dict[str, Any], names: list[str]) -> bytes:
    return json.dumps({"Pod": p, "NodeNames": names}).encode()


def test_pod_over_the_gpu_container_cap_is_refused_by_every_verb() -> None:
    ext = Extender(view_of(3), None, limits=Limits(max_gpu_containers=4))
    big = pod([{"kubegpu.io/gpu": "1"}] * 5)
    out = json.loads(asyncio.run(ext.filter(filter_body(big, ["n0", "n1", "n2"]))).body)
    assert out["NodeNames"] == [] and set(out["FailedAndUnresolvableNodes"]) == {"n0", "n1", "n2"}
    assert all("5 containers that ask for GPUs" in v and "at most 4" in v
               for v in out["FailedAndUnresolvableNodes"].values())
    scores = json.loads(asyncio.run(ext.prioritize(filter_body(big, ["n0", "n1"]))).body)
    assert [s["Score"] for s in scores] == [0, 0]
    # Non-GPU containers do not count; at the cap the pod is placed as usual.
    ok = pod([{"kubegpu.io/gpu": "1"}] * 4 + [{"cpu": "1"}] * 50)
    out = json.loads(asyncio.run(ext.filter(filter_body(ok, ["n0", "n1", "n2"]))).body)
    assert out["NodeNames"] == ["n0", "n1", "n2"]


def test_cap_counts_raw_containers_of_any_shape() -> None:
    assert too_many_gpu_containers({"spec": {"containers": "junk"}}, 1) == ""
    assert too_many_gpu_containers([], 1) == ""
    p = {"spec": {"initContainers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
                  "containers": [{"resources": {"limits": {"kubernetes.io/gpu-core": "5"}}}, 7, {"resources": 3}]}}
    assert L.count_gpu_containers(p) == 2
    assert too_many_gpu_containers(p, 1).startswith("the pod has 2 containers")


def test_aggregate_prefilter_rules_nodes_out_before_any_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    view = view_of(4)  # 8 GPUs a node: 800 % of compute
    calls = count()
    real_fit = verbs.fit  # the one exact test (Verbs.exact_fit) the bounded filter calls
    monkeypatch.setattr(verbs, "fit", lambda *a, **k: (next(calls), real_fit(*a, **k))[1])
    # Each container fits alone anywhere; together (9 x 100 % shares) no node can hold them.
    too_big = pod([{"kubegpu.io/gpu-core": "100", "kubegpu.io/gpu-memory-ratio": "50"}] * 9)
    out = asyncio.run(bounded_filter(view, plan_of(too_big), ["n0", "n1", "n2", "n3"], Limits()))
    assert out.passed == [] and next(calls) == 0
    assert all("'c3' and 5 more need 900 % of a GPU's compute in all" in why and "800 % free" in why
               for why in out.failed.values())
    whole = pod([{"nvidia.com/gpu": "4"}, {"nvidia.com/gpu": "5"}])
    out = asyncio.run(bounded_filter(view, plan_of(whole), ["n0"], Limits()))
    assert out.failed["n0"] == "containers 'c0', 'c1': 9 whole GPUs requested in all, 8 free"
    # Memory in bytes counts too: 3 x 30 GiB on one node of 8 x 40 or 80 GiB GPUs passes, 9 x 80 GiB does not.
    mem = pod([{"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory": "80Gi"}] * 9)
    out = asyncio.run(bounded_filter(view, plan_of(mem), ["n0"], Limits()))
    assert "GiB of GPU memory in all" in out.failed["n0"]
    fits = pod([{"kubegpu.io/gpu-core": "10", "kubegpu.io/gpu-memory": "30Gi"}] * 3)
    assert asyncio.run(bounded_filter(view, plan_of(fits), ["n0"], Limits())).passed == ["n0"]


def test_time_budget_stops_the_per_node_fits_with_a_reason() -> None:
    view = view_of(6)
    ticks = count()
    clock = lambda: next(ticks) * 0.1  # noqa: E731 - every reading is 100 ms later
    two = pod([{"kubegpu.io/gpu": "10"}, {"kubegpu.io/gpu": "20"}])
    out = asyncio.run(bounded_filter(view, plan_of(two), [f"n{i}" for i in range(6)],
                                     Limits(filter_budget_s=0.35), clock=clock))
    assert 0 < len(out.passed) < 6
    late = [n for n, why in out.failed.items() if "time budget of 350 ms ran out" in why]
    assert late and set(late) | set(out.passed) == {f"n{i}" for i in range(6)}
    assert out.reasons["time-budget"] == len(late)


def test_a_large_filter_gives_the_loop_back_to_a_small_one() -> None:
    view = view_of(200)
    ext = Extender(view, None, limits=Limits(slice_s=0.0, filter_budget_s=60))
    view.exact_fit_enough = 10**6  # examine every node
    big = pod([{"kubegpu.io/gpu": "1"}] * 30, uid="big")
    small = pod([{"nvidia.com/gpu": "1"}], uid="small", name="small")
    names = [f"n{i}" for i in range(200)]
    done: list[str] = []

    async def run(which: str, p: dict[str, Any]) -> None:
        resp = await ext.filter(filter_body(p, names))
        assert len(json.loads(resp.body)["NodeNames"]) == 200
        done.append(which)

    async def main() -> None:
        big_task = asyncio.create_task(run("big", big))
        await asyncio.sleep(0)  # the big one has started and yielded
        await run("small", small)
        await big_task

    asyncio.run(main())
    assert done == ["small", "big"]


def test_model_mask_cache_is_bounded() -> None:
    view = view_of(2)
    ext = Extender(view, None)
    for i in range(MAX_MODEL_MASKS + 5):
        p = pod([{"nvidia.com/gpu": "1"}], annotations={A.GPU_MODEL: f"model-{i}"})
        asyncio.run(ext.filter(filter_body(p, ["n0", "n1"])))
    assert len(view.mirror._model_masks) <= MAX_MODEL_MASKS


def test_bind_records_what_the_api_pod_asks_for(tmp_path: Path) -> None:
    from sched_harness import start_cluster

    api, ext = start_cluster(tmp_path, inventories=inventories(1), nodes=[])
    try:
        real = pod([{"nvidia.com/gpu": "8"}], uid="", name="eight")
        created = api.put_object(real)
        uid = created["metadata"]["uid"]
        forged = pod([{"kubegpu.io/gpu": "10"}], uid=uid, name="eight")
        http = httpx.Client(base_url=ext.url, timeout=10)
        r = http.post("/filter", content=filter_body(forged, ["n0"]))
        assert r.status_code == 200 and r.json()["NodeNames"] == ["n0"]
        r = http.post("/bind", json={"PodName": "eight", "PodNamespace": "default", "PodUID": uid, "Node": "n0"})
        assert r.status_code == 200 and r.json().get("Error", "") == ""
        stored = api.get_object("pods", "eight", "default")
        alloc = decode(stored["metadata"]["annotations"][A.DEVICE_ALLOCATED])
        grants = alloc.grants()
        assert len(grants) == 8 and all(g.core == 100 for g in grants)
        # A bind whose pod has more GPU containers than the cap is refused with the reason.
        api.put_object(pod([{"kubegpu.io/gpu": "1"}] * 40, uid="", name="wide"))
        r = http.post("/bind", json={"PodName": "wide", "PodNamespace": "default", "Node": "n0"})
        assert "40 containers that ask for GPUs" in r.json()["Error"]
    finally:
        ext.stop()
        api.stop()


def test_filter_keeps_nothing_of_the_pods_it_sees() -> None:
    import gc
    import tracemalloc

    ext = Extender(view_of(2), None)
    env = [{"name": f"V{i}", "value": "x" * 200} for i in range(2000)]  # ~0.5 MiB a pod

    def fat(i: int) -> bytes:
        p = pod([{"nvidia.com/gpu": "1"}], uid=f"fat-{i}")
        p["spec"]["containers"][0]["env"] = env
        return filter_body(p, ["n0", "n1"])

    asyncio.run(ext.filter(fat(-1)))  # warm up
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(40):  # 20 MiB of pods
        asyncio.run(ext.filter(fat(i)))
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 2 * 2**20, grown


def test_an_expensive_filter_steps_aside_while_a_cheap_request_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    view = view_of(50)
    view.exact_fit_enough = 10**6
    fits = count()
    real_fit = verbs.fit
    monkeypatch.setattr(verbs, "fit", lambda *a, **k: (next(fits), real_fit(*a, **k))[1])
    share = L.LoopShare(max_wait_s=60)
    big = pod([{"kubegpu.io/gpu": "1"}] * 4, uid="big")
    seen: list[int] = []

    async def cheap() -> None:
        with share.request():
            before = next(fits)
            for _ in range(10):  # a request that needs ten turns of the loop (reads, parsing, writes)
                await asyncio.sleep(0)
            seen.append(next(fits) - before - 1)

    async def expensive() -> L.FilterOutcome:
        with share.request():  # as the extender's handler counts every verb
            return await bounded_filter(view, plan_of(big), [f"n{i}" for i in range(50)],
                                        Limits(slice_s=0.0, filter_budget_s=60), share=share)

    async def main() -> None:
        task = asyncio.create_task(expensive())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await cheap()
        assert len((await task).passed) == 50

    asyncio.run(main())
    assert seen == [0]  # no node was fitted while the cheap request was being answered
