"""A local cluster: the stand-ins in this process, every kubegpu role in a process of its own.

In this process: the stand-in API server (real HTTP), one stand-in kubelet per node (the
device manager's real gRPC: Registration, ListAndWatch, GetPreferredAllocation, Allocate) with
its pod side (:class:`~kubegpu_standins.node_agent.StandinNode`), and the stand-in
kube-scheduler. As processes, started with their real command lines: ``kubegpu webhook``
(HTTPS, a CA made here), ``kubegpu scheduler`` (the extender) and one ``kubegpu node`` per node
in full mode on a shipped topology (through :mod:`kubegpu.demo.fakenode`, which adds a fault
inbox). Everything lives under one work directory; :meth:`LocalCluster.stop` ends every
process it started (SIGTERM, then SIGKILL after a bound) and is safe to call twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kubegpu.demo.child import PARENT_ENV
from kubegpu.install.render import scheduler_config
from kubegpu.install.values import Values
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.kubelet import StandinKubelet
from kubegpu_standins.node_agent import StandinNode
from kubegpu_standins.scheduler import StandinScheduler

log = logging.getLogger(__name__)

CLI = [sys.executable, "-c", "from kubegpu.demo.child import run; run()"]
FAKENODE = [sys.executable, "-m", "kubegpu.demo.fakenode"]
WEBHOOK_NAMESPACE = "kubegpu-system"
# The extender's managedResources as installed (the rendered KubeSchedulerConfiguration); the MIG and
# renamed replica names a node advertises are added when the nodes are known.
_EXTENDER = scheduler_config(Values())["extenders"][0]
MANAGED = frozenset(m["name"] for m in _EXTENDER["managedResources"])
IGNORED_BY_SCHEDULER = frozenset(m["name"] for m in _EXTENDER["managedResources"] if m["ignoredByScheduler"])
MAX_UNIX_PATH = 107  # sun_path is 108 bytes with its terminating NUL


class ClusterError(RuntimeError):
    """A part of the local cluster did not start; the message names it and quotes its log."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One fake node: its name, a shipped topology (or file) and extra ``kubegpu node`` flags."""

    name: str
    topology: str
    flags: tuple[str, ...] = ()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expected_resources(spec: NodeSpec) -> set[str]:
    """The device-plugin resources ``kubegpu node`` will register for this node (its own expansion)."""
    from kubegpu.cli.node_entry import parse_node_args
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.node.options import load_node_options

    options = load_node_options(parse_node_args(list(spec.flags), {}).config_flags, {})
    inv = FakeBackend(spec.topology, node_name=spec.name).discover()
    return {p.name for p in options.expand(inv) if p.devices}


@dataclass
class LocalCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (or use it as a context manager)."""

    workdir: Path
    nodes: Sequence[NodeSpec]
    say: Callable[[str], None] = lambda _m: None
    startup_timeout_s: float = 60.0
    api: ApiServer | None = None
    client: Any = None
    kubeconfig: Path | None = None
    webhook_url: str = ""
    extender_url: str = ""
    ca_file: Path | None = None
    kubelets: dict[str, StandinKubelet] = field(default_factory=dict)
    agents: dict[str, StandinNode] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    inboxes: dict[str, Path] = field(default_factory=dict)
    scheduler: StandinScheduler | None = None
    _starter: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="demo-start"), repr=False)

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        from kubegpu.kube.client import make_client

        longest = max((len(str(self.workdir.absolute() / "nodes" / n.name / "device-plugins")) for n in self.nodes),
                       default=0) + len("/nvidia-mig-1g.10gb+me.sock")
        if longest > MAX_UNIX_PATH:
            raise ClusterError(f"{self.workdir} is too deep: plugin sockets would be {longest} bytes long, over the "
                               f"{MAX_UNIX_PATH} a unix socket path may have; choose a shorter work dir")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.api = ApiServer().start()
        self.kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig")
        self.client = make_client(self.kubeconfig)
        self.say(f"API server (stand-in) on {self.api.url}")
        self._make_certs()
        self._start_webhook()
        self._start_extender()
        wanted: dict[str, set[str]] = {}
        for spec in self.nodes:
            try:
                wanted[spec.name] = expected_resources(spec)
            except Exception as exc:  # the daemon would refuse it the same way: say so before starting it
                raise ClusterError(f"node {spec.name} ({spec.topology} {' '.join(spec.flags)}): {exc}") from None
            self._start_node(spec)
        self._wait_ready(wanted)
        managed = set(MANAGED) | {r for rs in wanted.values() for r in rs}
        self.scheduler = StandinScheduler(self.client, self.extender_url, managed=managed,
                                          ignored=set(IGNORED_BY_SCHEDULER))

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        """Start a role and list it in :attr:`procs`, off the main thread: a Ctrl-C or SIGTERM becomes a
        KeyboardInterrupt in the main thread only, so it can never fall between the process existing and
        its entry here (a process the demo has no handle on would outlive it); :meth:`stop` waits for a
        start in progress before it signals the roles. The one starter thread lives until :meth:`stop`: the
        kernel sends a child its parent-death signal (:mod:`kubegpu.demo.child`) when the thread that started
        it ends, not only the process."""
        return self._starter.submit(self._start_process, name, argv).result()

    def _start_process(self, name: str, argv: list[str]) -> Proc:
        log_path = self.workdir / "logs" / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        env.pop("KUBECONFIG", None)
        with log_path.open("wb") as out:
            # A session of its own: a Ctrl-C at the terminal reaches the demo, which then stops
            # the roles in order, instead of every process dying at once.
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _make_certs(self) -> None:
        """A CA for this run and the webhook's serving certificate for 127.0.0.1 (what a caBundle would hold)."""
        from kubegpu.webhook.certs import generate_ca, issue_serving_cert

        certs = self.workdir / "webhook"
        certs.mkdir(exist_ok=True)
        ca = generate_ca()
        self.ca_file = certs / "ca.crt"
        self.ca_file.write_bytes(ca.cert_pem)
        issue_serving_cert(ca, ["127.0.0.1", "localhost"]).write(certs / "tls.crt", certs / "tls.key")

    def _start_webhook(self) -> None:
        certs = self.workdir / "webhook"
        port = free_port()
        self.webhook_url = f"https://127.0.0.1:{port}"
        self._spawn("webhook", [*CLI, "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert",
                                str(certs / "tls.crt"), "--tls-key", str(certs / "tls.key"),
                                "--namespace", WEBHOOK_NAMESPACE, "--log-level", "warning"])
        self.say(f"webhook (kubegpu webhook) on {self.webhook_url}, serving certificate from a demo CA")

    def _start_extender(self) -> None:
        port = free_port()
        self.extender_url = f"http://127.0.0.1:{port}"
        self._spawn("extender", [*CLI, "scheduler", "--kubeconfig", str(self.kubeconfig), "--listen",
                                 f"127.0.0.1:{port}", "--log-level", "warning"])
        self.say(f"scheduler extender (kubegpu scheduler) on {self.extender_url}")

    def _start_node(self, spec: NodeSpec) -> None:
        assert self.client is not None
        base = self.workdir / "nodes" / spec.name
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir(parents=True, exist_ok=True)
        kubelet = StandinKubelet(plugin_dir)
        kubelet.start()
        pod_resources = base / "pod-resources" / "kubelet.sock"
        kubelet.serve_pod_resources(pod_resources)
        self.kubelets[spec.name] = kubelet
        agent = StandinNode(spec.name, self.client, kubelet)
        agent.register()
        self.agents[spec.name] = agent
        inbox = base / "faults.jsonl"
        inbox.write_text("")  # a kept work dir must not replay the last run's faults
        self.inboxes[spec.name] = inbox
        self._spawn(f"node-{spec.name}", [
            *FAKENODE, str(inbox), "node", "--inventory", spec.topology, "--node-name", spec.name,
            "--kubeconfig", str(self.kubeconfig), "--device-plugin-dir", str(plugin_dir),
            "--pod-resources-socket", str(pod_resources), "--metrics-address", "off", "--log-level", "warning",
            *spec.flags])
        self.say(f"node {spec.name}: stand-in kubelet + kubegpu node --inventory {spec.topology}"
                 + (f" {' '.join(spec.flags)}" if spec.flags else ""))

    def _wait_ready(self, wanted: dict[str, set[str]]) -> None:
        assert self.api is not None and self.ca_file is not None
        deadline = time.monotonic() + self.startup_timeout_s
        pending = {"webhook", "extender", *(f"node-{n}" for n in wanted)}
        restarts = {"webhook": 2, "extender": 2}
        https = httpx.Client(verify=ssl.create_default_context(cafile=str(self.ca_file)), timeout=2.0)
        try:
            while pending:
                for proc in list(self.procs):
                    if proc.popen.poll() is None:
                        continue
                    if proc.name in restarts and restarts[proc.name] > 0 and _port_taken(proc.tail(1000)):
                        # Another process took the port between our probe and the role's bind: once more.
                        restarts[proc.name] -= 1
                        self.procs.remove(proc)
                        self.say(f"{proc.name}: its port was taken meanwhile; starting it on another")
                        if proc.name == "webhook":
                            self._start_webhook()
                        else:
                            self._start_extender()
                        continue
                    raise ClusterError(f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.tail()}")
                if "webhook" in pending and _healthy(https, f"{self.webhook_url}/healthz"):
                    pending.discard("webhook")
                    self.say("webhook ready")
                for name, resources in wanted.items():
                    key = f"node-{name}"
                    if key in pending and self._node_ready(name, resources):
                        pending.discard(key)
                        self.say(f"node {name} ready: {', '.join(sorted(resources))}")
                # The extender lists Nodes and Devices once before it is healthy: ask it last.
                if pending == {"extender"} and _healthy(https, f"{self.extender_url}/healthz"):
                    pending.discard("extender")
                    self.say("extender ready (Nodes, Devices and Pods listed)")
                if pending and time.monotonic() > deadline:
                    names = ", ".join(sorted(pending))
                    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs if p.name in pending)
                    raise ClusterError(f"not ready after {self.startup_timeout_s:.0f} s: {names}\n{tails}")
                if pending:
                    time.sleep(0.1)
        finally:
            https.close()

    def _node_ready(self, name: str, resources: set[str]) -> bool:
        assert self.api is not None
        kubelet = self.kubelets[name]
        if not all(r in kubelet.resources and kubelet.resources[r].lists_received > 0 for r in resources):
            return False
        try:
            self.api.get_object("devices", name, group="kubegpu.io")
        except Exception:
            return False
        self.agents[name].sync_device_status()
        return True

    # --- operations -----------------------------------------------------------------------------

    def inject(self, node: str, fault: dict[str, Any]) -> None:
        """Append one fault to the node's inbox; its ``kubegpu node`` applies it within ~50 ms."""
        with self.inboxes[node].open("a") as f:
            f.write(json.dumps(fault) + "\n")

    def alive(self) -> list[str]:
        """Names of the role processes that have exited (empty when all run)."""
        return [f"{p.name} (exit {p.popen.returncode})" for p in self.procs if p.popen.poll() is not None]

    # --- stop -----------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 5.0) -> None:
        self._starter.shutdown(wait=True)  # a role being started is in procs once this returns
        if self.scheduler is not None:
            self.scheduler.http.close()  # an idle keep-alive connection would hold up the extender's stop
            self.scheduler = None
        for proc in self.procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killed", proc.name, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()  # a killed process always ends; until it has, the role is still running
        for kubelet in self.kubelets.values():
            with contextlib.suppress(Exception):
                kubelet.stop()
        self.kubelets.clear()
        if self.api is not None:
            with contextlib.suppress(Exception):
                self.api.stop()
            self.api = None


def _port_taken(log_tail: str) -> bool:
    return "address already in use" in log_tail.lower() or "errno 98" in log_tail.lower()


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False
