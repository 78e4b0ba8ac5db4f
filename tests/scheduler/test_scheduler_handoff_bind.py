"""Issue 24: the one-waiting-pod rule is enforced at bind, where the extender serializes decisions.

kube-scheduler binds asynchronously (the next pod is filtered before the previous bind arrives), so identical
pods reach bind together. Bind lets one pod per (node, resource, count) wait for its handoff; the others wait
in bind (no back-off) and go on, one by one, as each is acknowledged or runs; past the wait bound, the bind
fails with the reason (kube-scheduler retries after its back-off)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest
from polling import until
from sched_harness import Cluster, mark_running, start_cluster
from test_scheduler_behaviour import pod, share


def _start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_s: str) -> Cluster:
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)  # as deployed: pods of one kind take turns
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT_S", wait_s)
    api, ext = start_cluster(tmp_path)
    return Cluster(api, ext)


def _bind_all(cluster: Cluster, names: list[str], node: str) -> cf.Future[list[str]]:
    uids = [cluster.api.put_object(pod(n, share(20, ratio=20)))["metadata"]["uid"] for n in names]

    def one(i: int) -> str:
        with httpx.Client(base_url=cluster.ext.url, timeout=30) as c:
            r = c.post("/bind", json={"PodName": names[i], "PodNamespace": "default", "PodUID": uids[i],
                                      "Node": node})
            return str(r.json().get("Error", ""))

    pool = cf.ThreadPoolExecutor(len(names) + 1)
    return pool.submit(lambda: list(pool.map(one, range(len(names)))))


def _bound(cluster: Cluster, names: list[str]) -> list[str]:
    pods = {p["metadata"]["name"]: p for p in cluster.api.objects("pods")}
    return [n for n in names if (pods.get(n, {}).get("spec") or {}).get("nodeName")]


def test_identical_binds_take_turns_on_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _start(tmp_path, monkeypatch, "20")
    try:
        names = ["a", "b", "c"]
        done = _bind_all(cluster, names, "gpu-node-c")
        assert until(lambda: len(_bound(cluster, names)) == 1)
        time.sleep(0.5)
        assert len(_bound(cluster, names)) == 1  # the others wait in bind: one waiting record per kind
        for turn in (2, 3):
            mark_running(cluster, _bound(cluster, names)[-1] if turn == 2 else
                 next(n for n in _bound(cluster, names) if cluster.api.get_object("pods", n, "default")
                      .get("status", {}).get("phase") != "Running"))
            assert until(lambda turn=turn: len(_bound(cluster, names)) == turn)
        assert done.result(timeout=10) == ["", "", ""]
    finally:
        cluster.ext.stop()
        cluster.api.stop()


def test_a_bind_that_waits_too_long_fails_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _start(tmp_path, monkeypatch, "0.3")
    try:
        errors = _bind_all(cluster, ["a", "b"], "gpu-node-c").result(timeout=10)
        assert sorted(errors)[0] == ""
        assert "being handed to the kubelet" in sorted(errors)[1] and "not its turn within 0.3 s" in sorted(errors)[1]
        assert len(_bound(cluster, ["a", "b"])) == 1
    finally:
        cluster.ext.stop()
        cluster.api.stop()


def test_prioritize_spreads_a_burst_away_from_nodes_handing_one_over() -> None:
    import random

    import numpy as np

    from kubegpu.scheduler.verbs import MAX_PRIORITY, away_from_handoffs

    def mask(names: list[str], which: object) -> np.ndarray:
        return np.array([n in which for n in names], bool)  # type: ignore[operator]

    names = ["a", "b", "c"]
    # b hands a pod of this kind over: a (which fits, however it scored) goes first; c does not fit.
    assert away_from_handoffs(names, np.array([0, 10, 0]), mask(names, {"b"}), mask(names, {"a", "b"}),
                              {}) == [1, 0, 0]
    # Every node it fits is busy: the shortest queue of waiting binds wins.
    assert away_from_handoffs(names, np.array([10, 3, 0]), mask(names, {"a", "b"}), mask(names, {"a", "b"}),
                              {"a": 4, "b": 1}) == [6, 9, 0]

    def rule(scores: list[int], blocked: set[str], fits_at: set[str], waiting: dict[str, int]) -> list[int]:
        """The rule node by node, as docs/handoff.md states it."""
        if not any(n in fits_at and n not in blocked for n in names):
            return [MAX_PRIORITY - min(MAX_PRIORITY - 1, waiting.get(n, 0)) if n in fits_at else s
                    for n, s in zip(names, scores, strict=True)]
        return [0 if n in blocked else max(s, 1) if n in fits_at else s for n, s in zip(names, scores, strict=True)]

    rng = random.Random(5)
    for _ in range(300):
        names = [f"n{rng.randrange(12)}" for _ in range(rng.randrange(1, 12))]  # repeats too
        scores = [rng.randrange(11) for _ in names]
        blocked = {n for n in names if rng.random() < 0.4}
        fits_at = {n for n in names if rng.random() < 0.6}
        waiting = {n: rng.randrange(15) for n in names if rng.random() < 0.5}
        assert away_from_handoffs(names, np.array(scores), mask(names, blocked), mask(names, fits_at),
                                  waiting) == rule(scores, blocked, fits_at, waiting)
