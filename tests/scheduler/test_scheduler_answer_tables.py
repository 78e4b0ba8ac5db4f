"""Issue 23: the filter and prioritize answers built from kept per-row tables (names' JSON by layout, reasons as
codes by row version, kube-scheduler's lists as windows of the held list) say exactly what an extender with
nothing kept says, through holds, releases, changed Device objects, new and removed nodes and label changes;
and each table's JSON decodes to what encoding the plain objects gives."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import filter_, hold_random, plan_of

from kubegpu.inventory.fake import FakeBackend
from kubegpu.scheduler import wire
from kubegpu.scheduler.reasons import NameTable, ReasonMap, TextTable, readable
from kubegpu.scheduler.state import ClusterView

SHAPES = [{"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": "4"},
          {"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory-ratio": "50"},
          {"kubegpu.io/gpu-core": "20", "kubegpu.io/gpu-memory": "4Gi"},
          {"kubegpu.io/gpu-core": "100", "kubegpu.io/gpu-memory-ratio": "50", "kubegpu.io/gpu.shared": "2"}]


def pod(i: int, limits: dict[str, str], cpu: str = "1", models: str = "") -> dict[str, Any]:
    requests = {**limits, "cpu": cpu, "memory": "1Gi"}
    meta: dict[str, Any] = {"name": f"p{i}", "namespace": "d", "uid": f"u{i}", "resourceVersion": "1"}
    if models:
        meta["annotations"] = {"kubegpu.io/gpu-model": models}
    return {"metadata": meta, "spec": {"containers": [{"name": "c", "resources": {"limits": limits,
                                                                                   "requests": requests}}]}}


def answers(view: ClusterView, memo: wire.NameMemo, p: dict[str, Any], names: list[str]) -> tuple[Any, Any]:
    """The filter answer and the prioritize answer (decoded) for ``names``, through the kept tables."""
    args = wire.decode_args(msgspec.json.encode({"Pod": p, "NodeNames": names}), memo)
    assert args.NodeNames is not None
    out = filter_(view, p, args.NodeNames)
    passed = memo.answered(out.passed, getattr(out, "passed_json", None))
    assert json.loads(passed) == list(out.passed)
    failed = json.loads(wire.encode(wire.ExtenderFilterResult(None, None, out.failed, {})))["FailedNodes"]
    assert failed == {k: readable(v) for k, v in out.failed.items()}
    pargs = wire.decode_args(b'{"Pod":' + msgspec.json.encode(p) + b',"NodeNames":' + passed + b"}", memo)
    assert pargs.NodeNames is not None
    scores = json.loads(view.prioritize_json(plan_of(p), pargs.NodeNames))
    assert [h["Score"] for h in scores] == view.prioritize(plan_of(p), list(pargs.NodeNames))
    return (list(out.passed), failed), scores


def fresh_copy(view: ClusterView) -> ClusterView:
    """A view with the same nodes and held pods, and nothing kept."""
    other = ClusterView(handoff_wait=False)
    other.scoring = view.scoring  # the same learned workload and policies (kept scores are by generation)
    for name, rec in view.nodes.items():
        other.set_node_labels(name, rec.labels)
        if rec.inventory is not None:
            other.set_inventory(name, rec.inventory)
    for key, h in view.ledger.held.items():
        other.ledger.hold(key, h.uid, h.node, h.alloc)
    return other


@pytest.mark.parametrize("seed", range(3))
def test_kept_answers_follow_every_change(seed: int) -> None:
    rng = random.Random(seed)
    view = ClusterView(handoff_wait=False)
    memo = wire.NameMemo()
    nodes = [f"n{i:02d}" for i in range(8)]
    for n in nodes:
        view.set_inventory(n, FakeBackend(rng.choice(["t4x4", "dgx-a100"]), node_name=n).discover())
    held: list[str] = []
    for step in range(60):
        names = nodes[step % len(nodes):] + nodes[:step % len(nodes)] + ["ghost"] * (step % 7 == 0)
        p = pod(step, rng.choice(SHAPES), models="T4" if step % 9 == 0 else "")
        if step % 13 == seed:  # tables built ahead of the requests (as after the first lists) answer the same
            view.warm_up()
        kept = answers(view, memo, p, names)
        assert kept == answers(fresh_copy(view), wire.NameMemo(), p, names), step
        op = rng.random()
        if op < 0.5:  # a pod takes a share or whole GPUs on some node
            key = f"d/h{step}"
            if not hold_random(view, rng, nodes, key):
                continue
            held.append(key)
        elif op < 0.75 and held:  # one leaves
            view.ledger.release(held.pop(rng.randrange(len(held))))
        elif op < 0.85:  # a Device object changes or goes away (new arrays when the shape changes)
            node = rng.choice(nodes)
            view.set_inventory(node, None if rng.random() < 0.3 else
                               FakeBackend(rng.choice(["t4x4", "dgx-a100"]), node_name=node).discover())
        elif op < 0.92:  # a product label: model masks and the layout change
            view.set_node_labels(rng.choice(nodes), {"nvidia.com/gpu.product": rng.choice(["Tesla-T4", "A100"])})
        else:  # a new node joins, with a longer name (the name tables are padded)
            node = f"node-{len(nodes)}-" + "x" * rng.randint(0, 9)
            nodes.append(node)
            view.set_inventory(node, FakeBackend("dgx-a100", node_name=node).discover())


def test_reason_map_json_is_the_map_encoded() -> None:
    table = NameTable(["a", "bb", "node-3", "d"])
    texts = TextTable()
    by_row = np.array(["a", "bb", "node-3", "d"], object)
    m = ReasonMap()
    assert m.json() == b"{}" and dict(m) == {}
    m.add_rows(by_row, np.array([2, 0]), table, texts, texts.codes(["50 % free", "no GPU"]))
    m.add_texts(by_row, np.array([1]), table, ["1 whole GPU(s) requested"])
    m["ghost"] = "no GPUs known"
    want = {"node-3": "50 % free", "a": "no GPU", "bb": "not enough GPUs: 1 whole GPUs requested",
            "ghost": "no GPUs known"}
    assert json.loads(m.json()) == {k: readable(v) for k, v in want.items()}
    assert dict(m) == {**want, "node-3": readable("50 % free")}  # rows' texts read back as sent
    only_loose, only_rows = ReasonMap(), ReasonMap()  # each part alone closes the map too
    only_loose["ghost"] = "no GPUs known"
    only_rows.add_rows(by_row, np.array([3]), table, texts, texts.codes(["no GPU"]))
    assert json.loads(only_loose.json()) == {"ghost": "no GPUs known"}
    assert json.loads(only_rows.json()) == {"d": "no GPU"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet='ab-. "\\\u00e9', min_size=1, max_size=9), min_size=1, max_size=12, unique=True),
       st.data())
def test_name_tables_encode_as_msgspec_does(names: list[str], data: st.DataObject) -> None:
    rows = np.array(data.draw(st.lists(st.integers(0, len(names) - 1), max_size=20)), np.int64)
    listed = [names[r] for r in rows.tolist()]
    got = NameTable(names).list_json(rows)
    assert got is None or got == msgspec.json.encode(listed)
    if all(" " not in n for n in names):
        assert got is not None
    scores = np.array(data.draw(st.lists(st.integers(0, 10), min_size=len(rows), max_size=len(rows))),
                           np.int64)
    host = wire.HostTable.build(names)
    if host is not None:
        answer = host.answer(rows, scores)
        assert answer is not None
        assert json.loads(answer) == [{"Host": n, "Score": s} for n, s in zip(listed, scores.tolist(), strict=True)]
        assert host.answer(rows, scores + 11) is None if len(rows) else True


def test_host_table_refuses_names_too_unequal_to_pad() -> None:
    assert wire.HostTable.build(["a", "b" * 40]) is None
    assert wire.HostTable.build([]) is None


def test_lists_are_read_as_windows_and_rows_without_listing_names() -> None:
    view = ClusterView(handoff_wait=False)
    names = [f"n{i}" for i in range(6)]
    for n in names:
        view.set_inventory(n, FakeBackend("t4x4", node_name=n).discover())
    memo = wire.NameMemo()
    memo.names(msgspec.json.encode(names))
    window = memo.names(msgspec.json.encode(names[4:] + names[:3]))
    assert isinstance(window, wire.NameWindow) and window == names[4:] + names[:3]
    assert view.node_rows(window).tolist() == [view.mirror.row(n) for n in names[4:] + names[:3]]
    out = filter_(view, pod(1, {"nvidia.com/gpu": "1"}), window)
    assert isinstance(out.passed, wire.RowNames) and out.passed._list is None  # not listed to be answered
    assert view.node_rows(out.passed) is out.passed.rows
    view.set_inventory("n9", FakeBackend("t4x4", node_name="n9").discover())  # new arrays: rows are looked up
    view.mirror.cluster  # noqa: B018
    assert view.node_rows(out.passed).tolist() == [view.mirror.row(n) for n in out.passed]
