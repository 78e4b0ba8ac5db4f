"""Whatever JSON arrives, a verb answers 200 (with per-node reasons or an Error) or 400: never an exception."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_harness import fixture_inventories

from kubegpu.scheduler.app import Extender
from kubegpu.scheduler.state import ClusterView
from kubegpu.scheduler.wire import WireError

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
_quantity = st.sampled_from(["1", "2", "0", "-1", "50", "150", "200", "8Gi", "1.5", "abc", "", "1e3", "100000"])
_resource = st.sampled_from(["nvidia.com/gpu", "kubegpu.io/gpu-core", "kubegpu.io/gpu-memory",
                             "kubegpu.io/gpu-memory-ratio", "kubegpu.io/gpu.shared", "kubegpu.io/gpu",
                             "nvidia.com/mig-1g.10gb", "kubegpu.io/bogus", "cpu"])
_container = st.fixed_dictionaries({"name": st.text(max_size=4), "resources": st.fixed_dictionaries(
    {"limits": st.dictionaries(_resource, _quantity, max_size=4)})})
_pod = st.fixed_dictionaries({"metadata": st.one_of(_json, st.fixed_dictionaries(
    {"name": st.text(max_size=4), "annotations": st.dictionaries(
        st.sampled_from(["kubegpu.io/gpu-model", "kubegpu.io/node-policy", "kubegpu.io/gpu-policy",
                         "kubegpu.io/require-nvlink"]), st.text(max_size=10), max_size=3)})),
    "spec": st.one_of(_json, st.fixed_dictionaries({"containers": st.lists(_container, max_size=3),
                                                    "initContainers": st.lists(_container, max_size=1)}))})
_names = st.lists(st.sampled_from(["gpu-node-a", "gpu-node-b", "gpu-node-c", "ghost", ""]), max_size=6)


def _extender() -> Extender:
    view = ClusterView(handoff_wait=False)
    for inv in fixture_inventories():
        view.set_inventory(inv.name, inv)
    return Extender(view, None)


EXT = _extender()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=st.one_of(_pod, _json), names=_names, verb=st.sampled_from(["filter", "prioritize"]),
       shape=st.sampled_from(["names", "nodes", "garbage"]))
def test_verbs_never_raise(pod: object, names: list[str], verb: str, shape: str) -> None:
    if shape == "names":
        body = {"Pod": pod, "Nodes": None, "NodeNames": names}
    elif shape == "nodes":
        body = {"Pod": pod, "Nodes": {"metadata": {}, "items": [{"metadata": {"name": n}} for n in names]},
                "NodeNames": None}
    else:
        body = {"Pod": pod, "NodeNames": pod}
    fn = EXT.filter if verb == "filter" else EXT.prioritize
    try:
        resp = asyncio.run(fn(json.dumps(body).encode()))
    except WireError:
        return  # answered 400 by the HTTP layer
    assert resp.status_code == 200
    out = json.loads(resp.body)
    if verb == "filter" and not out["Error"]:
        answered = set(out["NodeNames"] or [n["metadata"]["name"] for n in (out["Nodes"] or {}).get("items", [])])
        assert answered | set(out["FailedNodes"]) | set(out["FailedAndUnresolvableNodes"]) >= set(names)
    if verb == "prioritize":
        assert all(0 <= h["Score"] <= 10 for h in out)
