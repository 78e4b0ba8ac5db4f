"""The demo's story, step by step, through a :class:`~kubegpu.demo.cluster.LocalCluster`.

1. start the cluster (three fake nodes: an 8-GPU DGX A100, a 4-GPU T4 server, an A100 board
   with MIG in mixed strategy whose whole GPUs are time-sliced as ``nvidia.com/sharedgpu``, with no
   share slots);
2. send the first wave of pods through the webhook, create the admitted ones;
3. schedule (stand-in kube-scheduler + the extender) and admit (stand-in kubelets + the
   ``kubegpu node`` device plugins) until every pod runs; show the live view and the
   environments;
4. inject a critical Xid on a free GPU, wait for its ``Device`` entry to turn Unhealthy;
5. send a second wave pinned to that node; schedule and admit;
6. verify the end state (:mod:`kubegpu.demo.verify`).

Output goes through a :class:`Reporter` (rich, or nothing with ``quiet``); the result is a
:class:`DemoResult` whose ``summary`` is what ``--json`` prints.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, RenderableType
from rich.markup import escape as esc
from rich.table import Table

from kubegpu.demo.admission import Admission, AdmissionError, admit
from kubegpu.demo.cluster import LocalCluster, NodeSpec
from kubegpu.demo.pods import NAMESPACE, DemoPod, first_wave, second_wave
from kubegpu.demo.verify import (
    CORE,
    MEMORY,
    VISIBLE,
    Check,
    EndState,
    Run,
    XidFault,
    handoff_mismatches,
    record_of,
    replica_overlaps,
    verify,
)
from kubegpu.model.inventory import NodeInventory
from kubegpu.status.view import ClusterView, build_view

NODE_FLAGS = ("--health-recovery-interval", "0")  # an Xid'd GPU stays out until someone looks at it
NODES: tuple[NodeSpec, ...] = (
    NodeSpec("dgx-a100", "dgx-a100", NODE_FLAGS),
    NodeSpec("t4-server", "t4x4", NODE_FLAGS),
    # No share slots here: the kubelet time-slices these GPUs and the extender cannot see its replicas,
    # so fine-grained shares on them would be promised compute the replicas also use.
    NodeSpec("a100-mig", "a100-mig", (*NODE_FLAGS, "--mig-strategy", "mixed", "--resource-config",
                                      "gpu:sharedgpu:4", "--shared-slots", "0")),
)
ACK_WAIT_S = 15.0  # the end state waits this long at most for acknowledgements still on their way
XID = 48  # double-bit ECC error: critical, the GPU is marked Unhealthy
XID_MESSAGE = "double-bit ECC error (injected by kubegpu demo)"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    short: bool = False  # no pauses: what CI runs
    quiet: bool = False
    keep_running_s: float = 0.0
    workdir: Path | None = None  # kept when given (logs, kubeconfig); a temp dir otherwise
    settle_timeout_s: float = 30.0
    startup_timeout_s: float = 60.0


@dataclass(slots=True)
class DemoResult:
    ok: bool
    checks: list[Check]
    summary: dict[str, Any]


class Reporter:
    """What the demo shows; silent when quiet."""

    def __init__(self, console: Console, quiet: bool, t0: float) -> None:
        self.console, self.quiet, self.t0 = console, quiet, t0

    def step(self, title: str) -> None:
        if not self.quiet:
            self.console.rule(f"[bold]{title}")

    def say(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]{time.monotonic() - self.t0:6.2f}s[/] {message}", highlight=False)

    def show(self, renderable: RenderableType) -> None:
        if not self.quiet:
            self.console.print(renderable)


@dataclass
class _Tracker:
    """What happened so far: admissions, results of scheduling, containers started."""

    t0: float
    admissions: dict[str, Admission] = field(default_factory=dict)  # namespace/name
    specs: dict[str, DemoPod] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    seen_runs: set[tuple[str, str]] = field(default_factory=set)
    last_reason: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # pods the webhook could not review


def _key(dp: DemoPod) -> str:
    meta = dp.manifest["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


def short_id(value: str) -> str:
    """``GPU-94e1c108-fd63-…`` -> ``GPU-94e1c108``: enough to tell GPUs apart in a table."""
    return ",".join(v[:12] if v.startswith(("GPU-", "MIG-")) else v for v in value.split(","))


def _gib(n: int | str) -> str:
    try:
        return f"{int(n) / 2**30:.1f}Gi"
    except ValueError:
        return str(n)


def submit(cluster: LocalCluster, http: httpx.Client, pods: Iterable[DemoPod], tr: _Tracker,
           rep: Reporter) -> list[str]:
    """Webhook, then create; returns the keys created."""
    from kubegpu.kube.resources import Pod

    table = Table(title="admission (kubegpu webhook: /mutate, then /validate)", expand=False)
    for col in ("POD", "REQUEST STYLE", "VERDICT"):
        table.add_column(col, overflow="fold")
    created = []
    for dp in pods:
        key = _key(dp)
        tr.specs[key] = dp
        try:
            result = admit(http, cluster.webhook_url, dp.manifest)
        except AdmissionError as exc:  # the API server would fail the create (failurePolicy: Fail)
            tr.errors[key] = str(exc)
            table.add_row(esc(key), esc(dp.style), f"[red]webhook error[/]: {esc(str(exc))}")
            continue
        tr.admissions[key] = result
        if result.allowed:
            cluster.client.create(Pod.from_dict(result.pod))
            created.append(key)
            what = f"[green]admitted[/], {len(result.patch)} patch ops" if result.patch else "[green]admitted[/]"
            changes = [w for w in result.warnings if "set to" in w or "void" in w.lower()]
            verdict = what + "".join(f"\n{esc(w)}" for w in changes[:2])
            if any(op.get("path", "").endswith("/env") or "/env/" in op.get("path", "") for op in result.patch):
                verdict += "\nenv NVIDIA_VISIBLE_DEVICES=void added"
        else:
            verdict = f"[red]refused[/]: {esc(result.message)}"
        table.add_row(esc(key), esc(dp.style), verdict)
    rep.show(table)
    return created


def settle(cluster: LocalCluster, keys: Sequence[str], tr: _Tracker, rep: Reporter, *, timeout_s: float,
           pause_s: float) -> None:
    """Schedule and admit until every pod in ``keys`` is Running or Failed (or the time is up)."""
    from kubegpu.kube.resources import Pod

    assert cluster.scheduler is not None
    deadline = time.monotonic() + timeout_s
    while True:
        for r in cluster.scheduler.schedule_pending():
            text = f"bound to [bold]{esc(r.node)}[/]" if r.node else f"[yellow]pending[/]: {esc(r.message)}"
            if r.node and r.message:
                text += f" ({esc(r.message)})"
            if tr.last_reason.get(r.pod) != text:
                tr.last_reason[r.pod] = text
                rep.say(f"scheduler: {esc(r.pod)} {text}")
        for name, agent in cluster.agents.items():
            agent.sync_device_status()
            for key in agent.admit_pending():
                if key in agent.failed:
                    tr.failed[key] = agent.failed[key]
                    rep.say(f"kubelet {name}: [red]{esc(key)} failed[/]: {esc(agent.failed[key])}")
                else:
                    rep.say(f"kubelet {name}: {esc(key)} admitted, containers started")
            for (pod, container), run in agent.runs.items():
                if (pod, container) not in tr.seen_runs:
                    tr.seen_runs.add((pod, container))
                    tr.runs.append(Run(pod, container, name, run.environment,
                                       {k: list(v) for k, v in run.devices.items()}, time.monotonic() - tr.t0))
        phases = {}
        for p in cluster.client.list(Pod, namespace="*"):
            phases[f"{p.metadata.namespace}/{p.metadata.name}"] = p.status.phase if p.status else None
        if all(phases.get(k) in ("Running", "Failed") for k in keys):
            return
        if time.monotonic() > deadline:
            waiting = [k for k in keys if phases.get(k) not in ("Running", "Failed")]
            rep.say(f"[red]gave up waiting after {timeout_s:.0f} s for[/] {', '.join(waiting)}")
            return
        time.sleep(pause_s)


def snapshot(cluster: LocalCluster) -> tuple[dict[str, NodeInventory], ClusterView]:
    from kubegpu.status.sources import from_api_server

    snap = from_api_server(cluster.client, os.environ)  # replica holders and MIG layout come with it
    return {i.name: i for i in snap.inventories}, snap.view()


def live_view(cluster: LocalCluster, rep: Reporter, title: str) -> ClusterView:
    from kubegpu.cli.status import render_table

    _, view = snapshot(cluster)
    rep.step(title)
    rep.show(render_table(view))
    return view


def env_table(runs: Iterable[Run], title: str) -> Table:
    table = Table(title=title, expand=False)
    for col in ("POD[CONTAINER]", "NODE", VISIBLE, "CORE %", "MEMORY", "DEVICES (kubelet)"):
        table.add_column(col, overflow="fold")
    for r in sorted(runs, key=lambda r: (r.pod, r.container)):
        devices = "; ".join(f"{res}: {short_id(','.join(ids))}" for res, ids in r.devices.items()) or "-"
        cells = (f"{r.pod}[{r.container}]", r.node, short_id(r.env.get(VISIBLE, "-")), r.env.get(CORE, "-"),
                 _gib(r.env[MEMORY]) if MEMORY in r.env else "-", devices)
        table.add_row(*(esc(c) for c in cells))
    return table


def choose_xid_target(inventories: Mapping[str, NodeInventory], view: ClusterView, runs: Iterable[Run]
                      ) -> tuple[str, int, str] | None:
    """A healthy, whole (not MIG) GPU nobody holds, on the node with the most such GPUs (so pods
    pinned there still fit): ``(node, index, uuid)``; None when there is none."""
    used = {(r.node, d.split("::", 1)[0]) for r in runs for ids in r.devices.values() for d in ids}
    held = {(n.name, g.uuid) for n in view.nodes for g in n.gpus if g.holders}
    best: list[tuple[int, str, int, str]] = []
    for name, inv in sorted(inventories.items()):
        free = [g for g in inv.gpus if g.healthy and not g.mig_devices
                and (name, g.uuid) not in used and (name, g.uuid) not in held]
        if free:
            g = min(free, key=lambda g: g.index)
            best.append((-len(free), name, g.index, g.uuid))
    if not best:
        return None
    _, node, index, uuid = min(best)
    return node, index, uuid


def wait_unhealthy(cluster: LocalCluster, node: str, uuid: str, timeout_s: float) -> float | None:
    t = time.monotonic()
    deadline = t + timeout_s
    while time.monotonic() < deadline:
        inventories, _ = snapshot(cluster)
        inv = inventories.get(node)
        if inv and any(g.uuid == uuid and not g.healthy for g in inv.gpus):
            return time.monotonic() - t
        time.sleep(0.05)
    return None


def run_demo(opts: DemoOptions, console: Console, *, nodes: Sequence[NodeSpec] = NODES) -> DemoResult:
    t0 = time.monotonic()
    rep = Reporter(console, opts.quiet, t0)
    if opts.workdir is not None:
        return _run(opts, rep, opts.workdir, nodes, t0)
    # Unix socket paths are short (107 bytes): a deep $TMPDIR would not hold the plugin sockets.
    base = None if len(tempfile.gettempdir()) <= 40 or not Path("/tmp").is_dir() else "/tmp"
    with tempfile.TemporaryDirectory(prefix="kubegpu-demo-", dir=base) as tmp:
        return _run(opts, rep, Path(tmp), nodes, t0)


def _run(opts: DemoOptions, rep: Reporter, workdir: Path, nodes: Sequence[NodeSpec], t0: float) -> DemoResult:
    pause = 0.05 if opts.short else 0.4
    rep.step("starting the cluster (stand-in API server and kubelets; real kubegpu roles)")
    cluster = LocalCluster(workdir, nodes, say=lambda m: rep.say(esc(m)), startup_timeout_s=opts.startup_timeout_s)
    tr = _Tracker(t0)
    with cluster:
        startup_s = time.monotonic() - t0
        assert cluster.ca_file is not None
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cluster.ca_file)),
                          timeout=10.0) as http:
            _create_namespace(cluster, NAMESPACE)
            rep.step("wave 1: every request style, through the webhook")
            created = submit(cluster, http, first_wave(), tr, rep)
            rep.step("scheduling (stand-in kube-scheduler → kubegpu extender) and admission (kubelet → kubegpu node)")
            settle(cluster, created, tr, rep, timeout_s=opts.settle_timeout_s, pause_s=pause)
            live_view(cluster, rep, "live view after wave 1 (kubegpu status)")
            rep.show(env_table(tr.runs, "container environments (from the device plugins' Allocate)"))
            if not opts.short:
                time.sleep(1.0)

            xid, after = fail_a_gpu_then_fill_its_node(cluster, http, tr, rep, opts, pause)

            rep.step("end state")
            inventories, view = snapshot(cluster)
            rep.show(_render(view))
            state = _end_state(cluster, tr, inventories, view, xid, set(after))
            checks = verify(state)
            notes = [f"{g} serves time-slicing replicas and fine-grained shares at once: replicas are counted by "
                     "the kubelet, shares by the extender" for g in replica_overlaps(tr.runs)]
            _show_checks(rep, checks, notes)
            summary = _summary(tr, state, checks, notes, startup_s, time.monotonic() - t0)
            if opts.keep_running_s > 0:
                rep.say(f"cluster kept running for {opts.keep_running_s:.0f} s: kubegpu status --kubeconfig "
                        f"{cluster.kubeconfig}; extender debug API {cluster.extender_url}"
                        "/apis/v1/plugins/DeviceShare/nodeDeviceSummaries")
                time.sleep(opts.keep_running_s)
        rep.say("stopping every role")
    ok = all(c.ok for c in checks)
    return DemoResult(ok, checks, summary)


def fail_a_gpu_then_fill_its_node(cluster: LocalCluster, http: httpx.Client, tr: _Tracker, rep: Reporter,
                                  opts: DemoOptions, pause: float) -> tuple[XidFault | None, list[str]]:
    """Step 4 and 5: a critical Xid on a free GPU, then a wave of pods pinned to its node.
    Returns the fault (None when no GPU was free) and the second wave's pods."""
    rep.step(f"injecting Xid {XID} ({XID_MESSAGE.split(' (')[0]})")
    inventories, view = snapshot(cluster)
    target = choose_xid_target(inventories, view, tr.runs)
    if target is None:
        rep.say("[red]no free GPU to fail[/]")
        return None, []
    node, index, uuid = target
    at = time.monotonic() - tr.t0
    cluster.inject(node, {"kind": "xid", "gpu": index, "xid": XID, "message": XID_MESSAGE})
    rep.say(f"Xid {XID} on {node} GPU {index} ({uuid})")
    took = wait_unhealthy(cluster, node, uuid, timeout_s=15.0)
    if took is None:
        rep.say(f"[red]{node} GPU {index} did not turn Unhealthy in its Device object[/]")
    else:
        rep.say(f"{node} GPU {index} [red]Unhealthy[/] in the Device object after {took:.2f} s")
    cluster.agents[node].sync_device_status()
    kubelet = cluster.kubelets[node]
    counts = [f"{r} {kubelet.allocatable(r)}/{kubelet.capacity(r)}" for r in sorted(kubelet.resources)]
    rep.say(f"kubelet {node} allocatable/capacity: " + ", ".join(counts))
    live_view(cluster, rep, "live view after the Xid")
    if not opts.short:
        time.sleep(1.0)
    held = {g.uuid for n in view.nodes for g in n.gpus if g.holders}
    others_free = sum(1 for g in inventories[node].gpus
                      if g.healthy and not g.mig_devices and g.uuid != uuid and g.uuid not in held)
    rep.step(f"wave 2: pods pinned to {node}, beside the unhealthy GPU")
    # A whole-GPU pod too when room is left beside the two shares' GPU.
    whole = others_free >= 2 and "nvidia.com/gpu" in kubelet.resources
    after = submit(cluster, http, second_wave(node, whole=whole), tr, rep)
    settle(cluster, after, tr, rep, timeout_s=opts.settle_timeout_s, pause_s=pause)
    rep.show(env_table([r for r in tr.runs if r.pod in after], "wave 2 environments"))
    return XidFault(node, index, uuid, XID, at, took), after


def _create_namespace(cluster: LocalCluster, name: str) -> None:
    from lightkube.core.exceptions import ApiError
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace

    try:
        cluster.client.create(Namespace(metadata=ObjectMeta(name=name)))
    except ApiError as exc:
        if exc.status.code != 409:
            raise


def _render(view: ClusterView) -> RenderableType:
    from kubegpu.cli.status import render_table

    return render_table(view)


def _end_state(cluster: LocalCluster, tr: _Tracker, inventories: dict[str, NodeInventory], view: ClusterView,
               xid: XidFault | None, after: set[str]) -> EndState:
    from kubegpu.kube.resources import Pod

    # Acknowledgements are written after the Allocate answers, retried until they land (docs/handoff.md): the
    # last ones may still be on their way on a loaded machine. Read until they are in, or ACK_WAIT_S has passed
    # (check_handoff then reports what is missing or wrong).
    deadline = time.monotonic() + ACK_WAIT_S
    while True:
        pods = {f"{p.metadata.namespace}/{p.metadata.name}": p.to_dict()
                for p in cluster.client.list(Pod, namespace="*")}
        if not handoff_mismatches(pods, tr.runs)[0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    unhealthy = {name: {d for st in k.resources.values() for d in st.unhealthy} for name, k in cluster.kubelets.items()}
    from kubegpu.status.sources import SourceError, from_extender

    try:
        ext = from_extender(cluster.extender_url)
        extender_view: ClusterView | None = build_view(ext.inventories, ext.records)
    except SourceError:
        extender_view = None
    return EndState(
        extender_view=extender_view,
        expected_refused={k for k, dp in tr.specs.items() if dp.refused},
        expected_admitted={k for k, dp in tr.specs.items() if not dp.refused},
        admission_errors=dict(tr.errors),
        refusals={k: a.message for k, a in tr.admissions.items() if not a.allowed},
        pods=pods, runs=list(tr.runs), inventories=inventories, view=view, xid=xid, after_xid=after,
        kubelet_unhealthy=unhealthy, roles_exited=cluster.alive())


def _show_checks(rep: Reporter, checks: Sequence[Check], notes: Sequence[str]) -> None:
    table = Table(title="checks", expand=False)
    for col in ("", "CHECK", "DETAIL"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row("[green]✓[/]" if c.ok else "[red]✗[/]", esc(c.name), esc(c.detail))
    rep.show(table)
    for n in notes:
        rep.say(f"[yellow]note:[/] {esc(n)}")


def _summary(tr: _Tracker, state: EndState, checks: Sequence[Check], notes: Sequence[str], startup_s: float,
             total_s: float) -> dict[str, Any]:
    pods: dict[str, Any] = {}
    for key, dp in tr.specs.items():
        adm = tr.admissions.get(key)
        stored = state.pods.get(key)
        entry: dict[str, Any] = {"style": dp.style, "wave": dp.wave, "admitted": bool(adm and adm.allowed)}
        if adm is not None and not adm.allowed:
            entry["refusal"] = adm.message
        if stored is not None:
            entry["node"] = (stored.get("spec") or {}).get("nodeName")
            entry["phase"] = (stored.get("status") or {}).get("phase")
            if key in tr.failed:  # the kubelet's admission failure, so a failed pod says why in the JSON too
                entry["failure"] = tr.failed[key]
            record = record_of(stored)
            containers: dict[str, Any] = {}
            for r in state.runs:
                if r.pod != key:
                    continue
                alloc = record.for_container(r.container) if record else None
                containers[r.container] = {
                    "recorded": [{"uuid": g.uuid, "minor": g.minor, "mig": g.mig_uuid, "core": g.core,
                                  "memory_bytes": g.memory_bytes} for g in (alloc.grants if alloc else ())],
                    "env": {k: v for k, v in r.env.items() if k == VISIBLE or k.startswith("KUBEGPU_")},
                    "devices": {k: list(v) for k, v in r.devices.items()},
                }
            entry["containers"] = containers
        pods[key] = entry
    xid = state.xid
    return {
        "ok": all(c.ok for c in checks),
        "checks": [c.to_json() for c in checks],
        "pods": pods,
        "xid": None if xid is None else {"node": xid.node, "gpu": xid.gpu_index, "uuid": xid.uuid, "xid": xid.xid,
                                         "unhealthy_after_s": xid.unhealthy_after_s,
                                         "after_xid_pods": sorted(state.after_xid)},
        "view": state.view.to_json(),
        "notes": list(notes),
        "timings": {"startup_s": round(startup_s, 2), "total_s": round(total_s, 2)},
    }

