"""Benchmark: the starvation churn through the real extender (HTTP filter, prioritize, bind), with and without
reservations.

``bench/starvation.py`` measures the policy in the simulator; this runs the same stand-in churn
(:class:`kubegpu.sim.churn.Churn`: 10 nodes x 8 A100, pods at 1.7 pods/s living 20-90 s, withdrawn after 120 s
unplaced, each declaring its run time as ``activeDeadlineSeconds``) through ``kubegpu scheduler``'s app on a
loopback port, over the stand-in API server, as kube-scheduler would drive it: each scheduling pass offers the
waiting pods in arrival order to ``/filter``, scores the nodes that pass with ``/prioritize``, binds to the best
with ``/bind``. Time is virtual: the extender's clock is the churn's, and the run waits for the pod watch after
each departure, so what it measures is placement, not this machine's speed. ``--load`` replays the same pods arriving
at another multiple of the cluster's GPUs (the recording's is about 1.8).

Prints one line per run, then ONE JSON object as the last line: wide_pods_never_placed (target 0),
wide_wait_p99_s and small_wait_p99_s, the same ``_without`` reservations, and each run's widths.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

import kubegpu_standins.apiserver as standin_api
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.device_object import device_object
from kubegpu.placement.cluster import Demand
from kubegpu.placement.reservations import ReservationConfig, width_of
from kubegpu.scheduler.service import ServiceThread
from kubegpu.sim.churn import Churn
from kubegpu.sim.queue import QueuedPod, WidthStats
from kubegpu_standins.apiserver import ApiServer

WIDE = ("4", "8")
SMALL = ("share", "1", "2")
HELD_BACK = "GPUs held for a waiting wide pod"


class VirtualClock:
    """The extender's wall clock: the churn's time from a fixed epoch."""

    def __init__(self, epoch: float) -> None:
        self.epoch, self.t = epoch, 0.0

    def __call__(self) -> float:
        return self.epoch + self.t

    def stamp(self, t: float) -> str:
        """An API timestamp at churn time ``t``, in whole seconds as the API server writes them."""
        return datetime.fromtimestamp(int(self.epoch + t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def limits_of(d: Demand) -> dict[str, str]:
    """The pod's GPU limits for a churn demand (whole GPUs, or one share by ratio or by bytes)."""
    if d.exclusive:
        return {"nvidia.com/gpu": str(d.count)}
    out = {"kubegpu.io/gpu-core": str(d.milli // 10), "kubegpu.io/gpu.shared": "1"}
    if d.memory_ratio:
        out["kubegpu.io/gpu-memory-ratio"] = str(d.memory_ratio)
    else:
        out["kubegpu.io/gpu-memory"] = str(d.gpu_memory)
    return out


class Run:
    """One churn through one extender."""

    def __init__(self, churn: Churn, pods: list[QueuedPod], config: ReservationConfig, workdir: Path) -> None:
        self.churn, self.pods = churn, pods
        self.api = ApiServer(history=20000).start()
        for i in range(churn.nodes):
            name = f"gpu-node-{i + 2}"
            self.api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            self.api.put_object(device_object(FakeBackend("dgx-a100", node_name=name).discover()))
        self.clock = VirtualClock(float(int(time.time())))
        self.ext = ServiceThread(self.api.write_kubeconfig(workdir / "kubeconfig"), handoff_wait=False,
                                 reservations=config, clock=self.clock).start()
        self.http = httpx.Client(base_url=self.ext.url, timeout=30)
        self.kind = self.api.kind("pods")
        self.names = [f"gpu-node-{i + 2}" for i in range(churn.nodes)]
        self.created: dict[int, dict[str, Any]] = {}
        self.waits: dict[str, list[float]] = {}
        self.never: dict[str, int] = {}
        self.filters = 0

    def close(self) -> None:
        self.http.close()
        self.ext.stop()
        self.api.stop()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = self.http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        r.raise_for_status()
        return r.json()

    def _name(self, i: int) -> str:
        return f"c-{i:04d}"

    def arrive(self, i: int) -> None:
        p = self.pods[i]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self._name(i), "namespace": "churn"},
               "spec": {"schedulerName": "kubegpu-scheduler", "activeDeadlineSeconds": max(1, int(p.duration or 1) + 1),
                        "containers": [{"name": "c", "image": "x", "resources": {"limits": limits_of(p.demand)}}]}}
        # The stand-in stamps a pod's creation with its own clock: here, the churn's (the extender reads how long a
        # pod waited from that stamp, in the filter's body and in the watch alike).
        real_now, standin_api._now = standin_api._now, lambda: self.clock.stamp(p.arrive)
        try:
            self.created[i] = self.api.put_object(pod)
        finally:
            standin_api._now = real_now

    def remove(self, indices: list[int]) -> None:
        """Delete pods (ended or withdrawn) and wait until the extender's watch has released them."""
        for i in indices:
            self.api.store.delete(self.kind, "churn", self._name(i))
        self._settle([f"churn/{self._name(i)}" for i in indices], gone=True)

    def _settle(self, keys: list[str], gone: bool) -> None:
        """Wait until the extender's watch has shown ``keys`` gone, or (bound) their declared ends."""
        view = self.ext.service.view  # type: ignore[union-attr]
        r = view.reservations
        assert r is not None

        def seen() -> bool:
            if gone:
                return all(k not in view.ledger.held and k not in r.waiting for k in keys)
            return all(k in r.ends for k in keys)

        while not self.ext.call(seen):
            time.sleep(0.002)

    def try_place(self, i: int, t: float) -> tuple[bool, bool]:
        """(placed, refused only for lack of capacity: an identical pod cannot fit either in this pass)."""
        pod = self.created[i]
        self.filters += 1
        out = self._post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": self.names})
        nodes = out.get("NodeNames") or []
        if not nodes:
            return False, not any(HELD_BACK in r or r.startswith("waiting for")
                                  for r in (out.get("FailedNodes") or {}).values())
        scores = self._post("/prioritize", {"Pod": pod, "Nodes": None, "NodeNames": nodes})
        best = max(scores, key=lambda s: s["Score"])["Host"]  # first of the highest, as kube-scheduler's order
        meta = pod["metadata"]
        err = self._post("/bind", {"PodName": meta["name"], "PodNamespace": "churn", "PodUID": meta["uid"],
                                   "Node": best}).get("Error")
        if err:
            return False, False
        start = self.clock.stamp(t)
        self.api.store.update(self.kind, "churn", meta["name"],
                              lambda o: {**o, "status": {"phase": "Running", "startTime": start}},
                              subresource="status")
        return True, False

    def replay(self) -> float:
        began = time.perf_counter()
        arrivals = sorted(range(len(self.pods)), key=lambda i: (self.pods[i].arrive, i))
        ends: list[tuple[float, int]] = []
        queue: list[int] = []
        nxt = 0
        while nxt < len(arrivals) or ends or queue:
            give_up = min((self.pods[i].arrive + self.churn.give_up_s for i in queue), default=float("inf"))
            t = min(self.pods[arrivals[nxt]].arrive if nxt < len(arrivals) else float("inf"),
                    ends[0][0] if ends else float("inf"), give_up)
            if t == float("inf"):
                break
            self.clock.t = t
            leaving = []
            while ends and ends[0][0] <= t:
                leaving.append(heapq.heappop(ends)[1])
            for i in [i for i in queue if self.pods[i].arrive + self.churn.give_up_s <= t]:
                queue.remove(i)
                leaving.append(i)
                w = width_of(self.pods[i].demand)
                self.never[w] = self.never.get(w, 0) + 1
            if leaving:
                self.remove(leaving)
            while nxt < len(arrivals) and self.pods[arrivals[nxt]].arrive <= t:
                self.arrive(arrivals[nxt])
                queue.append(arrivals[nxt])
                nxt += 1
            full: set[Demand] = set()
            bound = []
            for i in list(queue):
                d = self.pods[i].demand
                if d in full:
                    continue
                placed, no_room = self.try_place(i, t)
                if placed:
                    queue.remove(i)
                    self.waits.setdefault(width_of(d), []).append(t - self.pods[i].arrive)
                    heapq.heappush(ends, (t + (self.pods[i].duration or 0.0), i))
                    bound.append(f"churn/{self._name(i)}")
                elif no_room:
                    full.add(d)
            self._settle(bound, gone=False)
        return time.perf_counter() - began

    def stats(self, widths: tuple[str, ...]) -> WidthStats:
        return WidthStats.of([w for k in widths for w in self.waits.get(k, ())],
                             sum(self.never.get(k, 0) for k in widths))


def main(pods: int | None, config: ReservationConfig, load: float | None = None,
         seed: int | None = None) -> dict[str, object]:
    churn = Churn() if seed is None else Churn(seed=seed)
    churn = churn if load is None else churn.at_load(load)
    queued = churn.pods()[:pods]
    runs: dict[str, Run] = {}
    for label, cfg in (("without", ReservationConfig(enabled=False)), ("with", config)):
        with tempfile.TemporaryDirectory() as tmp:
            run = Run(churn, queued, cfg, Path(tmp))
            try:
                seconds = run.replay()
            finally:
                run.close()
        runs[label] = run
        wide, small = run.stats(WIDE), run.stats(SMALL)
        print(f"extender churn, reservations {label}: wide never placed {wide.never_placed}, wide p99 "
              f"{wide.wait_p99_s:.1f} s, small p99 {small.wait_p99_s:.1f} s, small never placed {small.never_placed}, "
              f"{run.filters} filters in {seconds:.1f} s", file=sys.stderr, flush=True)
    return {
        "pods": len(queued),
        "offered_load": round(churn.offered_load, 2),
        "wide_pods_never_placed": runs["with"].stats(WIDE).never_placed,
        "wide_wait_p99_s": round(runs["with"].stats(WIDE).wait_p99_s, 3),
        "small_wait_p99_s": round(runs["with"].stats(SMALL).wait_p99_s, 3),
        "wide_pods_never_placed_without": runs["without"].stats(WIDE).never_placed,
        "wide_wait_p99_s_without": round(runs["without"].stats(WIDE).wait_p99_s, 3),
        "small_wait_p99_s_without": round(runs["without"].stats(SMALL).wait_p99_s, 3),
        "small_pods_never_placed": runs["with"].stats(SMALL).never_placed,
        "small_pods_never_placed_without": runs["without"].stats(SMALL).never_placed,
        "config": {"min_gpus": config.min_gpus, "wait_seconds": config.wait_seconds, "max_share": config.max_share},
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=None, help="only the first N pods of the churn (default: all 400)")
    ap.add_argument("--wait", type=float, default=5.0, help="reservation threshold, seconds (the churn's: 5)")
    ap.add_argument("--max-share", type=float, default=0.5, help="reservation budget (the churn's: 0.5)")
    ap.add_argument("--load", type=float, default=None,
                    help="the same pods arriving at this multiple of the cluster's GPUs (default: the recording's)")
    ap.add_argument("--seed", type=int, default=None, help="another draw of the churn's pods (default: its own)")
    args = ap.parse_args()
    print(json.dumps(main(args.pods, ReservationConfig(wait_seconds=args.wait, max_share=args.max_share),
                          args.load, args.seed)))
