"""Churn with restarts, on the stand-ins: the run of ``kubegpu-on-v1.36/turn4-scale.md`` at a smaller scale.

GPU nodes (``--nodes`` × 8 A100s), each a stand-in kubelet that posts its devices on its Node every
``--node-status-s`` (the kubelet's nodeStatusUpdateFrequency) with the real ``kubegpu node`` daemon, the real
extender and the stand-in kube-scheduler (``kubegpu_standins.gpu_cluster``). One node's daemon is ``--lag``
seconds from the API server (its requests and its watch). A generator creates bare pods, Poisson arrivals at
``--rate`` per second for ``--seconds``, drawn as the fixture's: 40 % shares (compute 10/25/30/50/70 %), 40 % one
whole GPU, 15 % two or four, 5 % eight; each pod is deleted a lifetime (``--hold`` range) after it is Running, a
Failed pod at once, a pod not Running ``--give-up-s`` after its creation then. Meanwhile the extender restarts,
a node daemon is stopped (SIGTERM) and started ``--down-s`` later, and a kubelet restarts. Then, on the emptied
cluster, the node-daemon restart repeated on purpose: 16 pods pinned to that node, one every 0.2 s alternating
a 10 % share and a whole GPU, the daemon stopped (SIGTERM) 1 s after the first and started ``--down-s`` later;
then the same with SIGKILL on another node (the daemon says nothing).

Prints one JSON object as its last line: ``rejected_at_node_restart`` (pods the kubelet rejected on the
SIGTERM-restarted node, in the churn and in its repeat; target 0), ``rejected_at_node_crash`` (on the SIGKILLed
node: bounded by the kubelet's status period, reported), ``rejected_at_kubelet_restart``,
``rejected_other`` (target 0), with their reasons,
``bind_refused_after_filter`` (binds refused for room that pods kube-scheduler placed took after the extender's
filter passed the node: no change in between; target 0), ``bind_refused_after_change`` (binds refused because
something really changed since the filter: a pod bound there not through this extender, the node's GPUs, the pod
itself, a filter by the extender before its restart; reported, with the reasons), ``bind_waits_failed`` (binds
past their handoff wait), ``bind_failed_otherwise`` (binds a node daemon or extender restart failed, or whose
answer did not come: with the reasons), ``filters_since_extender_restart`` (what the extender's filters did about
pods in flight: checked against them, waited for their binds, in vain, refused a node for a bind in progress),
``gpu_over_capacity`` (GPUs above 100 % by what containers were served, at every checkpoint; target 0),
``lost_or_double_counted`` (devices held twice, or containers whose GPUs disagree between environment, kubelet,
record and acknowledgement; target 0), ``ack_lag_s_p99_at_lag`` (on the lagged node: from the kubelet's last
``Allocate`` answer to the acknowledgement seen on the API server), ``running_s_p50`` / ``running_s_p99`` by pod
width (creation to Running), ``never_running``, ``pods``, ``elapsed_s``.

    .venv/bin/python bench/churn.py [--nodes 4] [--seconds 75] [--rate 1.5] [--seed 20261128] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubegpu.kube import Pod
from kubegpu.model import annotations as A
from kubegpu_standins.gpu_cluster import GpuCluster, NodeSpec, pod, share, whole

CORES = (10, 25, 30, 50, 70)
# What a failed bind's error says (scheduler/bind.py), by cause.
NO_CHANGE = "taken since by pods bound there"  # with "its filter passed the node": kube-scheduler's own pods
FILTERED_HERE = "its filter passed the node"
RESTARTING = ("is restarting", "reports no healthy", "still listing", "no extender")
AWAY = ("no healthy devices", "devices unavailable", "code = Unavailable", "code = Canceled")


@dataclass
class Tracked:
    name: str
    width: str  # "share", or the whole GPUs asked
    created: float
    running: float | None = None
    ends: float | None = None  # when the generator deletes it
    node: str = ""
    failed: str = ""
    acked: float | None = None
    gone: bool = False


@dataclass
class Run:
    cluster: GpuCluster
    rng: random.Random
    hold: tuple[float, float]
    give_up_s: float
    pods: dict[str, Tracked] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    over: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.t0, 2), what))
        logging.getLogger("churn").info("%s", what)

    def create(self, name: str, limits: dict[str, str], width: str, host: str | None = None) -> None:
        p = pod(name, limits, scheduler="kubegpu-scheduler", namespace="churn")
        if host is not None:
            p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": host}
        with self.lock:
            self.pods[name] = Tracked(name, width, time.monotonic())
        self.cluster.create(p)

    def draw(self, name: str) -> None:
        x = self.rng.random()
        if x < 0.4:
            self.create(name, share(self.rng.choice(CORES)), "share")
        else:
            n = 1 if x < 0.8 else self.rng.choice((2, 4)) if x < 0.95 else 8
            self.create(name, whole(n), str(n))

    def sweep(self) -> None:
        """One look at every pod: Running, acknowledged, Failed, past its lifetime or its patience."""
        now = time.monotonic()
        doomed: list[str] = []
        objects = {o["metadata"]["name"]: o for o in self.cluster.api.objects("pods")
                   if o["metadata"].get("namespace") == "churn"}
        with self.lock:
            for name, t in self.pods.items():
                if t.gone:
                    continue
                o = objects.get(name)
                if o is None:
                    continue
                status = o.get("status") or {}
                t.node = (o.get("spec") or {}).get("nodeName") or t.node
                if t.acked is None and A.DEVICE_ASSIGNED in (o["metadata"].get("annotations") or {}):
                    t.acked = now
                if status.get("phase") == "Running" and t.running is None:
                    t.running = now
                    t.ends = now + self.rng.uniform(*self.hold)
                if status.get("phase") == "Failed":
                    t.failed = str(status.get("message") or status.get("reason") or "Failed")
                    doomed.append(name)
                elif (t.ends is not None and now >= t.ends) or (t.running is None and now - t.created > self.give_up_s):
                    doomed.append(name)
            for name in doomed:
                self.pods[name].gone = True
        for name in doomed:
            with contextlib.suppress(Exception):  # already gone
                self.cluster.client.delete(Pod, name, namespace="churn")

    def clear(self, timeout_s: float = 30.0) -> None:
        """Delete every pod of the run and wait until they are gone."""
        with self.lock:
            names = [n for n, t in self.pods.items() if not t.gone]
            for n in names:
                self.pods[n].gone = True
        for n in names:
            with contextlib.suppress(Exception):
                self.cluster.client.delete(Pod, n, namespace="churn")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(o["metadata"].get("namespace") == "churn"
                                                  for o in self.cluster.api.objects("pods")):
            time.sleep(0.2)

    def settle(self, prefix: str, timeout_s: float) -> None:
        """Wait until every pod named ``prefix``-* is Running or Failed (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                mine = [t for n, t in self.pods.items() if n.startswith(prefix)]
                if all(t.running is not None or t.failed for t in mine):
                    return
            time.sleep(0.2)

    def checkpoint(self, label: str) -> None:
        c = self.cluster
        c.quiesce(10)
        over = c.overcommitted()
        live = {f"churn/{n}" for n, t in self.pods.items() if not t.gone}
        # An acknowledgement still on its way (a round trip after the answer, on the lagged node) is not a
        # disagreement: only what is there is compared.
        bad = [f"{k.pod}/{k.container}: env {k.env_gpus} kubelet {k.kubelet_gpus} record {k.record_gpus} "
               f"ack {k.ack_gpus}" for k in c.check() if k.pod in live and k.divergent and (k.ack_gpus or k.replica)]
        self.over.update(over)
        self.lost.update(bad + c.double_held())
        self.note(f"checkpoint {label}: {len(over)} GPUs over capacity, {len(bad)} divergent containers")


def restart(run: Run, node: str, *, kill: bool, down_s: float, after_s: float = 0.0) -> None:
    """``node``'s daemon stopped (or killed) and started ``down_s`` later, as the fixture's restarts."""
    sim = run.cluster.nodes[node]
    time.sleep(after_s)
    run.note(f"{node}: node daemon {'killed' if kill else 'stopped (SIGTERM)'}")
    sim.stop_daemon(kill=kill)
    time.sleep(down_s)
    sim.start_daemon()
    run.note(f"{node}: node daemon started")


def pinned_restart(run: Run, node: str, prefix: str, *, kill: bool, down_s: float) -> None:
    """The fixture's repeat: 16 pods pinned to ``node`` every 0.2 s, the daemon stopped 1 s after the first."""
    t = threading.Thread(target=restart, args=(run, node), kwargs={"kill": kill, "down_s": down_s, "after_s": 1.0},
                         name=f"restart-{node}")
    t.start()
    for i in range(16):
        if i % 2:
            run.create(f"{prefix}-{i:02d}-whole", whole(1), "1", host=node)
        else:
            run.create(f"{prefix}-{i:02d}-share", share(10), "share", host=node)
        time.sleep(0.2)
    t.join()


def in_flight_counts(c: GpuCluster) -> dict[str, int] | None:
    """What the extender's filters did about pods in flight (scheduler/inflight.py), since its last start: checked
    against them, waited for their binds, waited in vain (the bind did not come in time), refused a node a bind in
    progress holds."""
    if c.ext is None or c.ext.service is None:
        return None
    f = c.ext.service.extender.inflight
    out: dict[str, int] = c.ext.call(lambda: {"answered": f.unchecked + f.checked, "checked": f.checked,
                                               "waited": f.waited, "waited_in_vain": f.expired,
                                               "refused_for_bind_in_progress": f.refused})
    return out


def bind_failure_cause(error: str) -> str:
    """Why a bind failed, from its error: "no-change" (pods kube-scheduler placed after this pod's filter took its
    room: the filter should have counted them), "change" (something else changed since the filter), "wait" (past
    its handoff wait), "otherwise" (a node daemon or the extender restarting, or no answer from the extender)."""
    if "not its turn" in error:
        return "wait"
    if NO_CHANGE in error and FILTERED_HERE in error:
        return "no-change"
    if any(w in error for w in RESTARTING) or not error.startswith("kubegpu bind:"):
        return "otherwise"
    return "change"


def q(xs: list[float], f: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(f * len(xs)))], 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=75.0, help="how long the generator creates pods")
    ap.add_argument("--rate", type=float, default=1.5, help="pods per second (Poisson)")
    ap.add_argument("--hold", type=float, nargs=2, default=(10.0, 40.0), help="lifetime range once Running, s")
    ap.add_argument("--give-up-s", type=float, default=60.0, help="a pod not Running by then is deleted")
    ap.add_argument("--lag", type=float, default=0.5, help="one node daemon's one-way latency to the API server")
    ap.add_argument("--node-status-s", type=float, default=10.0, help="the kubelets' nodeStatusUpdateFrequency")
    ap.add_argument("--down-s", type=float, default=5.0, help="how long a restarted node daemon is away")
    ap.add_argument("--seed", type=int, default=20261128)
    ap.add_argument("--quick", action="store_true", help="a short run (tests): 2 nodes, 20 s, every restart")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.seconds, args.rate, args.hold = 3, 20.0, 1.0, (3.0, 8.0)
        args.give_up_s, args.node_status_s, args.down_s = 30.0, 2.0, 2.0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("churn").setLevel(logging.INFO)
    n = max(3, args.nodes)
    specs = [NodeSpec(f"gpu-node-{i}", "dgx-a100", watch_lag_s=args.lag if i == 0 else 0.0,
                      api_latency_s=args.lag if i == 0 else 0.0) for i in range(n)]
    term, crash, kubelet = "gpu-node-1", "gpu-node-2", "gpu-node-3" if n > 3 else "gpu-node-0"
    start = time.monotonic()
    with GpuCluster(specs, swap_prob=0.3, seed=args.seed, node_status_s=args.node_status_s) as c:
        run = Run(c, random.Random(args.seed), tuple(args.hold), args.give_up_s)  # type: ignore[arg-type]
        stop = threading.Event()

        def sweeper() -> None:
            while not stop.wait(0.2):
                run.sweep()

        sweep = threading.Thread(target=sweeper, name="churn-sweep", daemon=True)
        sweep.start()
        D = args.seconds
        events: list[tuple[float, str, Callable[[], None]]] = [
            (0.15 * D, "extender restart", c.restart_extender),
            (0.40 * D, f"{term}: node daemon restart (SIGTERM) in the churn",
             lambda: restart(run, term, kill=False, down_s=args.down_s)),
            (0.55 * D, "checkpoint", lambda: run.checkpoint("mid")),
            (0.70 * D, f"{kubelet}: kubelet restart", c.nodes[kubelet].restart_kubelet),
        ]
        threads: list[threading.Thread] = []
        t0 = run.t0 = time.monotonic()
        i = 0
        now = 0.0
        while now < D:
            gap = run.rng.expovariate(args.rate)
            now += gap
            while events and events[0][0] <= now:
                _, what, fn = events.pop(0)
                run.note(what)
                th = threading.Thread(target=fn, name=what, daemon=True)
                th.start()
                threads.append(th)
            time.sleep(max(0.0, t0 + now - time.monotonic()))
            run.draw(f"c-{i:04d}")
            i += 1
        for th in threads:
            th.join(120)
        run.checkpoint("churn")
        # The repeats on purpose, as recorded: after the churn, on an emptied cluster, 16 pods pinned to a node
        # whose daemon is stopped (then killed, on another node) 1 s after the first.
        run.clear()
        for node, prefix, kill in ((term, "r-term", False), (crash, "r-kill", True)):
            run.note(f"{node}: the pinned repeat ({'SIGKILL' if kill else 'SIGTERM'})")
            pinned_restart(run, node, prefix, kill=kill, down_s=args.down_s)
            run.settle(prefix, args.give_up_s)
        run.checkpoint("end")
        stop.set()
        sweep.join(5)
        causes: dict[str, list[str]] = {"no-change": [], "change": [], "wait": [], "otherwise": []}
        for when, _, _, e in c.bind_errors:
            cause = bind_failure_cause(e)
            # when it failed says which restart it met (the extender's binds in flight at its restart end so)
            causes[cause].append(f"{e} (at {when - run.t0:.0f} s)" if cause == "otherwise" else e)
        pods = list(run.pods.values())
        restarts = {"extender": c.extender_restarts,
                    "node_daemon": sum(x.daemon_restarts for x in c.nodes.values()),
                    "kubelet": sum(x.kubelet_restarts for x in c.nodes.values())}
        filters = in_flight_counts(c)

    def rejected(where: Callable[[Tracked], bool]) -> list[Tracked]:
        return [t for t in pods if t.failed and where(t)]

    at_term = rejected(lambda t: t.node == term)
    at_crash = rejected(lambda t: t.node == crash)
    at_kubelet = rejected(lambda t: t.node == kubelet)
    other = rejected(lambda t: t.node not in (term, crash, kubelet))
    out: dict[str, Any] = {
        "pods": len(pods),
        "rejected_at_node_restart": len(at_term),
        "rejected_at_node_crash": len(at_crash),
        "rejected_at_kubelet_restart": len(at_kubelet),
        "rejected_other": len(other),
        "rejected_reasons": sorted({t.failed[:160] for t in at_term + at_crash + at_kubelet + other}),
        "bind_refused_after_filter": len(causes["no-change"]),
        "bind_refused_after_filter_reasons": sorted({e[:240] for e in causes["no-change"]})[:5],
        "bind_refused_after_change": len(causes["change"]),
        "bind_refused_after_change_reasons": sorted({e[:240] for e in causes["change"]})[:5],
        "bind_waits_failed": len(causes["wait"]),
        "filters_since_extender_restart": filters,
        "bind_failed_otherwise": len(causes["otherwise"]),
        "bind_failed_otherwise_reasons": sorted({e[:160] for e in causes["otherwise"]})[:5],
        "gpu_over_capacity": len(run.over),
        "lost_or_double_counted": len(run.lost),
        "lost_or_double_counted_examples": sorted(run.lost)[:3],
        "ack_lag_s_p99_at_lag": None,
        "never_running": sum(1 for t in pods if t.running is None and not t.failed),
        "restarts": restarts,
        "node_status_s": args.node_status_s,
        "lag_s": args.lag,
    }
    lag_node = c.nodes["gpu-node-0"]
    ack_lag = []
    for t in pods:
        res = lag_node.admitter.results.get(f"churn/{t.name}")
        if t.node == "gpu-node-0" and t.acked is not None and res is not None and res.ok:
            ack_lag.append(max(0.0, t.acked - res.done_at))
    out["ack_lag_s_p99_at_lag"] = q(ack_lag, 0.99)
    for width in ("share", "1", "2", "4", "8"):
        xs = [t.running - t.created for t in pods if t.width == width and t.running is not None]
        out[f"running_s_p50_{width}"] = q(xs, 0.5)
        out[f"running_s_p99_{width}"] = q(xs, 0.99)
        out[f"ran_{width}"] = f"{len(xs)}/{sum(1 for t in pods if t.width == width)}"
    out["timeline"] = run.timeline
    out["elapsed_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
