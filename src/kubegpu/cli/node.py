"""``kubegpu node``: the node daemon (kubelet device plugins, health, metrics).

Takes NVIDIA's device-plugin flags, environment variables and config file unchanged (any
``--<flag> value`` from ``kubegpu.node.config``; precedence flag > env > file), plus:

- ``--standalone``: no API server (drop-in for NVIDIA's plugin); otherwise a kubeconfig or
  in-cluster credentials are required, the node state (labels, Device object, share
  capacity) is published by ``kubegpu.node.kube_publisher.KubeNodePublisher`` and Allocate
  is matched to the scheduler's choice by ``kubegpu.node.handoff.make_resolver``;
- ``--inventory <shipped name or file>``: GPUs from a topology file (fake backend) instead of NVML;
- ``--dry-run``: print the resources that would be served and exit.

Signals: SIGHUP reloads the config and restarts every plugin server; SIGTERM / SIGINT stop
cleanly (sockets removed). Exit codes: 0 clean stop, 1 init failure (failOnInitError),
2 bad configuration.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app

EXIT_OK, EXIT_INIT, EXIT_CONFIG = 0, 1, 2
log = logging.getLogger("kubegpu.node")


def _epilog() -> str:
    """Every NVIDIA device-plugin and kubegpu option, from the config's option table (its one source)."""
    from kubegpu.node.config import OPTIONS
    from kubegpu.node.config.options import CONFIG_FILE_ENV, CONFIG_FILE_FLAG
    from kubegpu.node.config.select import CONFIG_DIR_ENV, CONFIG_DIR_FLAG

    def default(o: Any) -> str:
        d = o.default
        if isinstance(d, tuple):
            return ",".join(map(str, d)) or "none"
        if o.kind == "duration":
            return f"{d:g}s"
        return str(d) if d != "" else "none"

    paragraphs = ["NVIDIA device-plugin and kubegpu options (also read from the environment variable named, "
                  "and from the config file; flag > environment > file > default):"]
    from kubegpu.node.config.refused import REFUSED

    for o in OPTIONS:
        names = " / ".join(f"--{n}" for n in (o.flag, *o.aliases))
        if o.key in REFUSED:
            paragraphs.append(f"{names}: {o.help}; accepted only at NVIDIA's default, kubegpu cannot honour "
                              f"other values [{', '.join(o.envs)}]")
            continue
        choices = f" ({', '.join(o.choices)})" if o.choices and o.kind in ("choice", "choices") else ""
        if o.kind == "bool":
            shown = f"{names}=false" if o.default else names
            state = "on by default" if o.default else "off unless given"
            paragraphs.append(f"{shown}: {o.help}; {state} [{', '.join(o.envs)}]")
        else:
            paragraphs.append(f"{names} VALUE: {o.help}{choices}; default {default(o)} [{', '.join(o.envs)}]")
    paragraphs.append(f"--{CONFIG_FILE_FLAG} FILE: the config file (NVIDIA's format plus a kubegpu: section) "
                      f"[{CONFIG_FILE_ENV}]")
    paragraphs.append(f"--{CONFIG_DIR_FLAG} DIR: the mounted config.map entries; the node's "
                      f"nvidia.com/device-plugin.config label picks one, else the config file above is used "
                      f"[{CONFIG_DIR_ENV}]")
    return "\n\n".join(paragraphs)


def parse_extra_flags(args: list[str]) -> dict[str, Any]:
    """``["--mig-strategy", "mixed", "--pass-device-specs", "--x=y"]`` -> ``{"mig-strategy": "mixed", ...}``.

    A flag followed by another flag (or nothing) is a boolean ``true``. Validation of names
    and values is the config loader's."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or a == "--":
            raise ValueError(f"unexpected argument {a!r} (options look like --name value)")
        name, eq, value = a[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        out[name] = value
        i += 1
    return out


def _backend(inventory: str | None, node_name: str | None, driver_root: str | None = None) -> Any:
    if inventory:
        from kubegpu.inventory.fake import FakeBackend

        return FakeBackend(inventory, node_name=node_name)
    try:
        from kubegpu.inventory.nvml import NvmlBackend  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError(f"the NVML backend is not available ({exc}); use --inventory for a topology file") \
            from None
    # NVML from the host driver root mounted in the container (as NVIDIA's plugin), else the library path.
    return NvmlBackend(node_name=node_name, driver_root=driver_root)


def _cluster_seams(kubeconfig: str | None, node_name: str, flags: Mapping[str, Any],
                   env: Mapping[str, str], registry: Any = None) -> tuple[Any, Any]:
    """(publisher, resolver) for full mode; raises RuntimeError without credentials."""
    try:
        from kubegpu.kube.client import make_client
    except ImportError as exc:
        raise RuntimeError(f"the Kubernetes adapter is not available ({exc}); run with --standalone") from None
    try:
        client = make_client(kubeconfig)
    except Exception as exc:
        raise RuntimeError(f"no Kubernetes credentials ({exc}); give --kubeconfig, run in-cluster, "
                           "or use --standalone") from None
    from kubegpu.node.config import load_config
    from kubegpu.node.handoff import make_resolver
    from kubegpu.node.kube_publisher import KubeNodePublisher

    config = load_config(flags=flags, env=env)
    publisher = KubeNodePublisher(client, node_name, config)
    resolver = make_resolver(client, node_name, pod_resources_socket=config.kubegpu.pod_resources_socket,
                             registry=registry)
    return publisher, resolver


class NodeConfigLabel:
    """The node's ``nvidia.com/device-plugin.config`` label, read from its Node (never in standalone mode).

    ``watch`` polls it and asks the daemon to reload when it changes, as NVIDIA's config-manager restarts
    the plugin."""

    POLL_S = 30.0

    def __init__(self, kubeconfig: str | bool | None, node_name: str | None) -> None:
        # False: standalone; None: in-cluster credentials where they exist; a path: that kubeconfig.
        self.enabled = kubeconfig is not False and (
            isinstance(kubeconfig, str) or bool(os.environ.get("KUBERNETES_SERVICE_HOST")))
        self.kubeconfig = kubeconfig if isinstance(kubeconfig, str) else None
        self.node_name = node_name or os.environ.get("NODE_NAME") or ""
        self.value: str | None = None
        self._client: Any = None

    def _fetch(self) -> str | None:
        from kubegpu.kube.client import make_client
        from kubegpu.kube.resources import Node
        from kubegpu.node.config.select import CONFIG_LABEL

        if self._client is None:
            self._client = make_client(self.kubeconfig)
        node = self._client.get(Node, self.node_name)
        return (node.metadata.labels or {}).get(CONFIG_LABEL)

    def read(self) -> str | None:
        if not self.enabled or not self.node_name:
            return None
        try:
            self.value = self._fetch()
        except Exception as exc:  # the API server is briefly away: keep the last known selection
            log.warning("cannot read this node's config label (%s); keeping %r", exc, self.value)
        return self.value

    def watch(self, stop: threading.Event, reload: threading.Event) -> None:
        if not self.enabled or not self.node_name:
            return

        def loop() -> None:
            while not stop.wait(self.POLL_S):
                before = self.value
                try:
                    now = self._fetch()
                except Exception:
                    continue
                if now != before:
                    log.info("node label nvidia.com/device-plugin.config changed %r -> %r: reloading", before, now)
                    reload.set()

        threading.Thread(target=loop, name="config-label", daemon=True).start()


def _print_plans(console: Console, plans: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"resource": p.name, "socket": p.socket_name, "devices": [d.id for d in p.devices],
                           "sharing": p.sharing, "replicas": p.replicas} for p in plans]))
        return
    table = Table(title="resources")
    for col in ("resource", "socket", "devices", "sharing"):
        table.add_column(col)
    for p in plans:
        table.add_row(p.name, p.socket_name, str(len(p.devices)),
                      p.sharing + (f" x{p.replicas}" if p.shared else ""))
    console.print(table)


def _metrics(address: str, metrics: Any, daemon: Any = None) -> None:
    """Serve /metrics, /healthz and /readyz; raises MetricsAddressError (the address is taken, ...)."""
    if not address or address in ("0", "off", "none"):
        return
    from kubegpu.node.metrics import MetricsAddressError, serve

    host, _, port = address.rpartition(":")
    try:
        number = int(port or 0)
    except ValueError:
        raise MetricsAddressError(f"cannot serve metrics on {address!r}: the port is not a number") from None
    server, _ = serve(metrics, number, host or "0.0.0.0", daemon)
    log.info("metrics on http://%s:%d/metrics (and /healthz, /readyz)", host or "0.0.0.0", server.server_port)


def run_daemon(daemon: Any, *, stop: threading.Event, reload: threading.Event,
               run_for: float | None = None, on_tick: Callable[[], None] | None = None) -> int:
    """Start the daemon and serve until ``stop`` (or ``run_for`` seconds); reload on ``reload``."""
    from kubegpu.node.config import ConfigError
    from kubegpu.node.daemon import DaemonInitError

    try:
        daemon.start()
    except DaemonInitError as exc:
        log.error("%s", exc)
        return EXIT_INIT
    # Everything allocated so far lives as long as the process: keep it out of the cyclic
    # collector so full collections do not stall Allocate (tail latency).
    gc.collect()
    gc.freeze()
    deadline = time.monotonic() + run_for if run_for else None
    try:
        while not stop.is_set():
            stop.wait(0.2)
            if reload.is_set():
                reload.clear()
                try:
                    daemon.reload()
                except ConfigError as exc:
                    log.error("reload refused, keeping the running config: %s", exc)
                except DaemonInitError as exc:
                    log.error("%s", exc)
                    return EXIT_INIT
            if on_tick is not None:
                on_tick()
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        daemon.stop()
    return EXIT_OK


@app.command(
    "node",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog=_epilog(),
)
def node_command(
    ctx: typer.Context,
    standalone: bool = typer.Option(False, "--standalone", help="Run without an API server (node-only mode)."),
    inventory: str | None = typer.Option(
        None, "--inventory", metavar="TOPOLOGY",
        help="Topology file or shipped name (dgx-a100, dgx1-v100, ...) instead of NVML."),
    node_name: str | None = typer.Option(None, "--node-name", envvar="NODE_NAME", metavar="NAME",
                                         help="This node's name."),
    kubeconfig: str | None = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG", metavar="FILE",
                                          help="Kubeconfig for full mode (in-cluster credentials otherwise)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resources that would be served, then exit."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: JSON output for scripts."),
    run_for: float | None = typer.Option(None, "--run-for", metavar="SECONDS",
                                         help="Stop by itself after this many seconds."),
    log_level: str = typer.Option("info", "--log-level", metavar="LEVEL", help="debug, info, warning or error."),
    kubelet_plugin: str = typer.Option("device-plugin", "--kubelet-plugin", envvar="KUBEGPU_KUBELET_PLUGIN",
                                       metavar="KIND",
                                       help="device-plugin, or dra (Kubernetes 1.34+: ResourceSlices and claims; "
                                            "see kubegpu.node.dra.cli for the --dra-* flags)."),
) -> None:
    """Serve this node's GPUs to the kubelet (device plugins), watch their health, export metrics.

    Any NVIDIA device-plugin flag (e.g. --mig-strategy mixed, --device-list-strategy cdi-cri,
    --pass-device-specs, --config-file FILE) and kubegpu's own (--device-plugin-dir,
    --shared-slots, --resource-config gpu:sharedgpu:4, --metrics-address) may follow.
    """
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    console = make_console(stderr=True)
    from kubegpu.node.config import ConfigError
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.metrics import NodeMetrics
    from kubegpu.node.options import load_node_options

    try:
        flags = parse_extra_flags(list(ctx.args))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    env: Mapping[str, str] = dict(os.environ)
    if kubelet_plugin not in ("device-plugin", "dra"):
        console.print(f"[red]error:[/red] --kubelet-plugin {kubelet_plugin!r}: expected device-plugin or dra")
        raise typer.Exit(EXIT_CONFIG)
    if kubelet_plugin == "dra":  # the node serves its GPUs through DRA only (never both ways)
        from kubegpu.node.dra.cli import run_dra

        try:
            dra_backend = _backend(inventory, node_name)
        except Exception as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(EXIT_INIT) from None
        raise typer.Exit(run_dra(flags, env, backend=dra_backend, kubeconfig=kubeconfig, node_name=node_name,
                                 run_for=run_for, dry_run=dry_run, as_json=as_json))

    from kubegpu.node.config.select import with_node_config

    # NVIDIA's per-node selection: the node's nvidia.com/device-plugin.config label names the config entry.
    label = NodeConfigLabel(False if standalone else kubeconfig, node_name)

    def load() -> Any:
        return load_node_options(with_node_config(flags, env, label.read()), env)

    try:
        options = load()
    except ConfigError as exc:
        console.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        from kubegpu.node.config import load_config

        if inventory:  # a topology file: no driver to find (the demo replaces this two-argument call)
            backend = _backend(inventory, node_name)
        else:
            backend = _backend(inventory, node_name, load_config(
                flags=with_node_config(flags, env, label.value), env=env).flags.plugin.container_driver_root)
    except Exception as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(EXIT_INIT) from None

    if dry_run:
        try:
            plans = list(options.expand(backend.discover()))
        except Exception as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(EXIT_INIT) from None
        _print_plans(console if not as_json else make_console(), plans, as_json)
        raise typer.Exit(EXIT_OK)

    metrics = NodeMetrics()
    publisher = resolver = None
    if not standalone:
        try:
            publisher, resolver = _cluster_seams(kubeconfig, node_name or backend.discover().name, flags, env,
                                                 metrics.registry)
        except Exception as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(EXIT_INIT) from None

    daemon = NodeDaemon(backend, load, publisher=publisher, resolver=resolver, metrics=metrics)
    try:
        from kubegpu.node.config import load_config

        _metrics(load_config(flags=flags, env=env).kubegpu.metrics_address, metrics, daemon)
    except OSError as exc:  # the address is taken or not this host's: say which, and stop
        console.print(f"[red]error:[/red] {exc} (set --metrics-address, or 0 to serve no metrics)")
        raise typer.Exit(EXIT_INIT) from None
    stop, reload = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    label.watch(stop, reload)
    log.info("kubegpu node starting (%s mode, plugin dir %s)", "standalone" if standalone else "cluster",
             options.plugin_dir)
    code = run_daemon(daemon, stop=stop, reload=reload, run_for=run_for)
    backend.close()
    raise typer.Exit(code)
