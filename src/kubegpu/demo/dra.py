"""``kubegpu demo --dra``: the DRA path end to end on this machine, and checks of what came out.

It runs the stand-in API server (real HTTP), the stand-in kubelet DRA manager (real gRPC on unix
sockets), kube-scheduler's allocator and the claim controller (``kubegpu_standins``), and kubegpu's
DRA driver on a fake 4-GPU A100 node: GPU 0 and 1 split by MIG, GPU 2 and 3 taking a whole claim or
shares, as claims come. It installs the DeviceClasses ``kubegpu manifests --dra`` ships, then runs:

1. a whole GPU from a ResourceClaimTemplate;
2. a 1g.10gb MIG device by profile class;
3. three 30 % shares, which skip the GPU the whole claim holds and share the other one, and a
   fourth that waits until one ends;
4. ``nvidia.com/gpu: 1`` served by DRA (extended-resource mapping);
5. an Xid: the GPU is tainted in its ResourceSlice, then recovers;

and prints each container's CDI environment and ``kubegpu status``, then the verdict
(``demo passed: N/N checks``, as the plain demo). ``quiet`` prints only the verdict. The node
daemon's own log lines (the Xid warning the demo causes on purpose) are kept out of the output and
counted in the summary (``node_log_warnings``); ``--debug`` shows them.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

GROUP = "resource.k8s.io"
NODE = "dra-node"


@dataclass
class DraDemoResult:
    checks: list[tuple[str, bool]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.checks)


def _wait(cond: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Until ``cond`` holds; the bound only stops a hang (a loaded machine may take many seconds), it is never
    what the demo expects to take."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class _Held(logging.Handler):
    """Keeps the node daemon's log records for the summary instead of the demo's output."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_dra_demo(console: Console, *, workdir: Path | None = None, quiet: bool = False) -> DraDemoResult:
    """Run the DRA demo; the verdict goes to ``console``, the rest too unless ``quiet``."""
    node_log = logging.getLogger("kubegpu.node")
    held = _Held()
    propagate = node_log.propagate
    if not node_log.isEnabledFor(logging.DEBUG):  # --debug shows everything as it happens
        node_log.addHandler(held)
        node_log.propagate = False
    try:
        return _run(console, workdir, quiet, held)
    finally:
        node_log.removeHandler(held)
        node_log.propagate = propagate


def _run(console: Console, workdir: Path | None, quiet: bool, held: _Held) -> DraDemoResult:
    from kubegpu.install.dra import device_classes
    from kubegpu.install.values import Values
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.kube.client import make_client
    from kubegpu.node.dra.daemon import DraDaemon, DraOptions
    from kubegpu.node.dra.names import DRIVER
    from kubegpu.node.dra.prepare import cdi_spec_path
    from kubegpu.node.dra.slices import DraSettings
    from kubegpu.status.sources import from_api_server
    from kubegpu_standins.apiserver import ApiServer

    try:
        from kubegpu_standins.dra_allocator import Allocator, ClaimController
    except ImportError as exc:  # cel-python is a development dependency
        raise RuntimeError(f"kubegpu demo --dra evaluates DeviceClass selectors (CEL) with cel-python, which is not "
                           f"installed ({exc}); pip install 'kubegpu[dev]' or cel-python") from None
    from kubegpu_standins.dra_kubelet import DraKubelet

    verdict_to = console
    if quiet:
        console = Console(file=io.StringIO())
    root = workdir or Path(tempfile.mkdtemp(prefix="kgdra-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    res = DraDemoResult()
    started = time.monotonic()
    api = ApiServer().start()
    kubelet = DraKubelet(api, root / "kubelet", NODE, retry_s=1.0)
    daemon: DraDaemon | None = None
    try:
        kubelet.start()
        backend = FakeBackend("a100-mig", node_name=NODE)
        client = make_client(api.write_kubeconfig(root / "kubeconfig"))
        opts = DraOptions(settings=DraSettings(node_name=NODE, shared_gpus=None),
                          plugins_dir=str(root / "kubelet" / "plugins"),
                          registry_dir=str(root / "kubelet" / "plugins_registry"), cdi_dir=str(root / "cdi"),
                          recovery_interval_s=0.5, health_wait_s=0.05, socket_check_s=0.2)
        daemon = DraDaemon(backend, opts, client)
        daemon.start()
        def pool_ready() -> bool:
            """Every slice of the newest pool generation is published and no device is tainted: the allocator
            sees the whole node (the driver publishes its slices one by one, after its registration)."""
            slices = api.objects("resourceslices", GROUP)
            if not slices:
                return False
            newest = max(s["spec"]["pool"]["generation"] for s in slices)
            pool = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
            return (len(pool) == pool[0]["spec"]["pool"]["resourceSliceCount"]
                    and not any(d.get("taints") for s in pool for d in s["spec"].get("devices") or []))

        registered = _wait(lambda: DRIVER in kubelet.plugins and pool_ready())
        res.checks.append(("the driver registered (v1.DRAPlugin) and published its ResourceSlices", registered))
        for c in device_classes(Values(), extended_resource=True):
            api.put_object(c)
        table = Table(title=f"ResourceSlices of {NODE}", title_justify="left")
        for col in ("device", "type", "profile / capacity"):
            table.add_column(col)
        for s in api.objects("resourceslices", GROUP):
            for d in s["spec"].get("devices") or []:
                a = d["attributes"]
                cap = ", ".join(f"{k} {v['value']}" for k, v in d.get("capacity", {}).items())
                kind = a["type"]["string"] + (" (whole or shares)" if d.get("allowMultipleAllocations") else "")
                table.add_row(d["name"], kind, a.get("profile", {}).get("string") or cap)
        console.print(table)

        alloc, ctl = Allocator(api), ClaimController(api)

        def claim(name: str, request: dict[str, Any]) -> None:
            api.put_object({"apiVersion": f"{GROUP}/v1", "kind": "ResourceClaim",
                            "metadata": {"name": name, "namespace": "demo"},
                            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}})

        def pod(name: str, claims: list[dict[str, Any]], limits: dict[str, str] | None = None) -> dict[str, Any]:
            res_ = {"claims": [{"name": c["name"]} for c in claims]} if claims else {"limits": limits or {}}
            return api.put_object({"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": name, "namespace": "demo", "uid": str(uuid.uuid4())},
                                   "spec": {"nodeName": NODE, "resourceClaims": claims,
                                            "containers": [{"name": "main", "image": "cuda", "resources": res_}]}})

        def run(p: dict[str, Any]) -> bool:
            if not ctl.schedule(alloc, p):
                return False
            kubelet.add_pod(api.get_object("pods", p["metadata"]["name"], "demo"))
            return _wait(lambda: p["metadata"]["uid"] in kubelet.running)

        def env_of(claim_name: str) -> list[str]:
            c = api.get_object("resourceclaims", claim_name, "demo", GROUP)
            spec = json.loads(cdi_spec_path(root / "cdi", c["metadata"]["uid"]).read_text())
            return [e for e in spec["containerEdits"]["env"] if not e.startswith("KUBEGPU_DRIVER")]

        api.put_object({"apiVersion": f"{GROUP}/v1", "kind": "ResourceClaimTemplate",
                        "metadata": {"name": "one-gpu", "namespace": "demo"},
                        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                            "deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}}]}}}})
        whole = pod("trainer", [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])
        ok = run(whole)
        gen = [c for c in api.objects("resourceclaims", GROUP, "demo") if c["metadata"]["name"].startswith("trainer-")]
        res.checks.append(("a whole GPU from a claim template is prepared and the pod runs", ok and len(gen) == 1))
        if ok and gen:  # a pod that did not run has no prepared claim to show
            console.print(f"[bold]trainer[/] (whole GPU): {', '.join(env_of(gen[0]['metadata']['name']))}")

        claim("mig-small", {"deviceClassName": "mig-1g.10gb.kubegpu.io", "allocationMode": "ExactCount", "count": 1})
        ok = run(pod("notebook", [{"name": "gpu", "resourceClaimName": "mig-small"}]))
        got = api.get_object("resourceclaims", "mig-small", "demo", GROUP)["status"]["allocation"]["devices"][
            "results"][0]["device"] if ok else ""
        res.checks.append(("a 1g.10gb MIG device by profile class", ok and "-mig-1g10gb-" in got))
        if ok:
            console.print(f"[bold]notebook[/] (MIG {got}): {', '.join(env_of('mig-small'))}")

        share = {"deviceClassName": "shared-gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1,
                 "capacity": {"requests": {"compute": "30", "memory": "20Gi"}}}
        shares = []
        for i in range(1, 5):
            claim(f"share-{i}", share)
            shares.append(pod(f"infer-{i}", [{"name": "gpu", "resourceClaimName": f"share-{i}"}]))
        three = all(run(p) for p in shares[:3])
        fourth_waits = not ctl.schedule(alloc, shares[3])
        trainer_gpu = gen[0]["status"]["allocation"]["devices"]["results"][0]["device"] if gen and (
            api.get_object("resourceclaims", gen[0]["metadata"]["name"], "demo", GROUP).get("status")) else ""
        share_gpus = {api.get_object("resourceclaims", f"share-{i}", "demo", GROUP)["status"]["allocation"][
            "devices"]["results"][0]["device"] for i in range(1, 4)} if three else set()
        res.checks.append(("three 30 % shares share one GPU beside the whole one, the fourth waits",
                           three and fourth_waits and len(share_gpus) == 1 and trainer_gpu not in share_gpus))
        if three:
            console.print(f"[bold]infer-1[/] (30 % share): {', '.join(env_of('share-1'))}")
        console.print(f"[bold]infer-4[/] waits: {alloc.last_failure}")
        kubelet.remove_pod(shares[0])
        api.store.delete(api.kind("pods"), "demo", "infer-1")
        ctl.pod_gone(alloc, shares[0])
        res.checks.append(("when infer-1 ends, infer-4 is allocated and runs", run(shares[3])))

        ok = run(pod("legacy", [], {"nvidia.com/gpu": "1"}))
        res.checks.append(("nvidia.com/gpu: 1 is served by DRA (extended-resource claim)", ok))

        gpu2 = backend.discover().gpus[2]
        backend.inject_xid(2, 79)

        def taint_on_gpu2() -> bool:
            return any(d["name"] == "gpu-2" and d.get("taints")
                       for s in api.objects("resourceslices", GROUP) for d in s["spec"].get("devices") or [])

        tainted = _wait(taint_on_gpu2)
        res.checks.append(("an Xid taints the GPU in its ResourceSlice (NoSchedule)", tainted))
        console.print(f"Xid 79 on GPU 2 ({gpu2.uuid}): tainted gpu.kubegpu.io/xid-error=79:NoSchedule")
        cleared = _wait(lambda: not taint_on_gpu2())
        res.checks.append(("the GPU recovers and the taint is removed", cleared))

        view = from_api_server(client, os.environ).view()
        st = Table(title="kubegpu status (DRA claims)", title_justify="left")
        for col in ("gpu", "holders", "core used"):
            st.add_column(col)
        for n in view.nodes:
            for g in n.gpus:
                st.add_row(str(g.index), ", ".join(h.pod for h in g.holders) or "-", f"{g.core_used} %")
        console.print(st)
        res.checks.append(("kubegpu status shows the claims", any(g.holders for n in view.nodes for g in n.gpus)))
        # A 1g.10gb is 1 of 7 GPU-instance slices, counted as the device-plugin path counts it (14 %).
        mig_core = [h.core for n in view.nodes for g in n.gpus for h in g.holders if h.pod == "demo/notebook"]
        res.checks.append(("the 1g.10gb claim counts 14 % of its GPU in kubegpu status", mig_core == [14]))
        for name, ok in res.checks:
            console.print(("[green]✓[/] " if ok else "[red]✗[/] ") + name)
        total_s = round(time.monotonic() - started, 2)
        passed = sum(ok for _, ok in res.checks)
        verdict_to.print((f"[green]demo passed[/]: {passed}/{len(res.checks)} checks" if res.ok else
                          f"[red]demo failed[/]: {len(res.checks) - passed} of {len(res.checks)} checks failed")
                         + f" in {total_s:.1f} s (DRA)")
        res.summary = {"ok": res.ok, "mode": "dra", "checks": [{"name": n, "ok": o} for n, o in res.checks],
                       "passed": passed,
                       "prepares": sum(1 for c in kubelet.calls if c.method == "NodePrepareResources"),
                       "node_log_warnings": len(held.records), "timings": {"total_s": total_s}}
        return res
    finally:
        if daemon is not None:
            daemon.stop()
        kubelet.stop()
        api.stop()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
