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
    try:
        from kubegpu.node.config import flag_help
    except ImportError:  # pragma: no cover - config module missing in a partial checkout
        return ""
    from rich.markup import escape

    lines = ["NVIDIA device-plugin and kubegpu options (flag / env / default):"]
    for flag, env, default, _help in flag_help():
        lines.append(escape(f"{flag} ({env}) [{default}]"))
    return "\n\n".join(lines)


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


def _backend(inventory: str | None, node_name: str | None) -> Any:
    if inventory:
        from kubegpu.inventory.fake import FakeBackend

        return FakeBackend(inventory, node_name=node_name)
    try:
        from kubegpu.inventory.nvml import NvmlBackend  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError(f"the NVML backend is not available ({exc}); use --inventory for a topology file") \
            from None
    return NvmlBackend(node_name=node_name)


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


def _metrics(address: str, metrics: Any) -> None:
    if not address or address in ("0", "off", "none"):
        return
    from kubegpu.node.metrics import serve

    host, _, port = address.rpartition(":")
    server, _ = serve(metrics, int(port or 0), host or "0.0.0.0")
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", server.server_port)


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
        None, "--inventory", help="Topology file or shipped name (dgx-a100, dgx1-v100, ...) instead of NVML."),
    node_name: str | None = typer.Option(None, "--node-name", envvar="NODE_NAME", help="This node's name."),
    kubeconfig: str | None = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG",
                                          help="Kubeconfig for full mode (in-cluster credentials otherwise)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resources that would be served, then exit."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: JSON output for scripts."),
    run_for: float | None = typer.Option(None, "--run-for", help="Stop by itself after this many seconds."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
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

    def load() -> Any:
        return load_node_options(flags, env)

    try:
        options = load()
    except ConfigError as exc:
        console.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        backend = _backend(inventory, node_name)
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

    try:
        from kubegpu.node.config import load_config

        _metrics(load_config(flags=flags, env=env).kubegpu.metrics_address, metrics)
    except (OSError, ValueError) as exc:
        log.warning("metrics endpoint not started: %s", exc)

    daemon = NodeDaemon(backend, load, publisher=publisher, resolver=resolver, metrics=metrics)
    stop, reload = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    log.info("kubegpu node starting (%s mode, plugin dir %s)", "standalone" if standalone else "cluster",
             options.plugin_dir)
    code = run_daemon(daemon, stop=stop, reload=reload, run_for=run_for)
    backend.close()
    raise typer.Exit(code)
