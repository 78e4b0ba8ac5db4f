"""``kubegpu node`` without the CLI framework: what the node daemon runs, and its lean entry point.

The node daemon lives on every GPU node for the node's lifetime, beside NVIDIA's plugin budget
(20-30 MB); its target is 60 MB resident. typer (with the pydantic it parses options with), rich and
the other commands' modules cost about 12 MB of that and do nothing once the options are read. So
``kubegpu.cli.main`` hands a process started as ``kubegpu node ...`` to :func:`lean_main`, which reads
the command's own options exactly as the typer command declares them (:mod:`kubegpu.cli.node`) and
runs :func:`run_node`; any argument list it does not take as it is (``--help``, a malformed or
missing value, ``--``, a short option) goes to the typer command instead, which then prints the same
help and the same errors as it always did. Both paths run the same :func:`run_node`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EXIT_OK, EXIT_INIT, EXIT_CONFIG = 0, 1, 2
log = logging.getLogger("kubegpu.node")


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


def _print_plans(console: Any, plans: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"resource": p.name, "socket": p.socket_name, "devices": [d.id for d in p.devices],
                           "sharing": p.sharing, "replicas": p.replicas} for p in plans]))
        return
    from rich.table import Table

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


@dataclass(frozen=True)
class NodeArgs:
    """The options of ``kubegpu node`` itself (declared in :func:`kubegpu.cli.node.node_command`); every
    other argument is a node config flag, kept in ``extra`` in the order given."""

    standalone: bool = False
    inventory: str | None = None
    node_name: str | None = None
    kubeconfig: str | None = None
    dry_run: bool = False
    as_json: bool = False
    run_for: float | None = None
    log_level: str = "info"
    kubelet_plugin: str = "device-plugin"
    extra: tuple[str, ...] = field(default=())


def _error(markup: str) -> None:
    """One error line on stderr, through the same rich console as every command (imported only here)."""
    from kubegpu.cli.console import make_console

    make_console(stderr=True).print(markup)


def run_node(args: NodeArgs, backend_factory: Callable[..., Any] = _backend) -> int:
    """Serve this node's GPUs until stopped; the exit code (0 clean stop, 1 init failure, 2 bad configuration).

    ``backend_factory`` is ``_backend`` unless a caller (the demo) replaced :data:`kubegpu.cli.node._backend`."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    inventory, node_name, kubeconfig = args.inventory, args.node_name, args.kubeconfig
    try:
        flags = parse_extra_flags(list(args.extra))
    except ValueError as exc:
        _error(f"[red]error:[/red] {exc}")
        return EXIT_CONFIG
    env: Mapping[str, str] = dict(os.environ)
    if args.kubelet_plugin not in ("device-plugin", "dra"):
        _error(f"[red]error:[/red] --kubelet-plugin {args.kubelet_plugin!r}: expected device-plugin or dra")
        return EXIT_CONFIG
    if args.kubelet_plugin == "dra":  # the node serves its GPUs through DRA only (never both ways)
        from kubegpu.node.dra.cli import run_dra

        try:
            dra_backend = backend_factory(inventory, node_name)
        except Exception as exc:
            _error(f"[red]error:[/red] {exc}")
            return EXIT_INIT
        return run_dra(flags, env, backend=dra_backend, kubeconfig=kubeconfig, node_name=node_name,
                       run_for=args.run_for, dry_run=args.dry_run, as_json=args.as_json)

    # Imported past the DRA branch: a DRA node never loads the device-plugin servers.
    from kubegpu.node.config import ConfigError
    from kubegpu.node.config.select import with_node_config
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.metrics import NodeMetrics
    from kubegpu.node.options import load_node_options

    # NVIDIA's per-node selection: the node's nvidia.com/device-plugin.config label names the config entry.
    label = NodeConfigLabel(False if args.standalone else kubeconfig, node_name)

    def load() -> Any:
        return load_node_options(with_node_config(flags, env, label.read()), env)

    try:
        options = load()
    except ConfigError as exc:
        _error(f"[red]configuration error:[/red] {exc}")
        return EXIT_CONFIG
    try:
        from kubegpu.node.config import load_config

        if inventory:  # a topology file: no driver to find (the demo replaces this two-argument call)
            backend = backend_factory(inventory, node_name)
        else:
            backend = backend_factory(inventory, node_name, load_config(
                flags=with_node_config(flags, env, label.value), env=env).flags.plugin.container_driver_root)
    except Exception as exc:
        _error(f"[red]error:[/red] {exc}")
        return EXIT_INIT

    if args.dry_run:
        try:
            plans = list(options.expand(backend.discover()))
        except Exception as exc:
            _error(f"[red]error:[/red] {exc}")
            return EXIT_INIT
        if args.as_json:
            _print_plans(None, plans, True)
        else:
            from kubegpu.cli.console import make_console

            _print_plans(make_console(stderr=True), plans, False)
        return EXIT_OK

    metrics = NodeMetrics()
    publisher = resolver = None
    if not args.standalone:
        try:
            publisher, resolver = _cluster_seams(kubeconfig, node_name or backend.discover().name, flags, env,
                                                 metrics.registry)
        except Exception as exc:
            _error(f"[red]error:[/red] {exc}")
            return EXIT_INIT

    daemon = NodeDaemon(backend, load, publisher=publisher, resolver=resolver, metrics=metrics)
    try:
        from kubegpu.node.config import load_config

        _metrics(load_config(flags=flags, env=env).kubegpu.metrics_address, metrics, daemon)
    except OSError as exc:  # the address is taken or not this host's: say which, and stop
        _error(f"[red]error:[/red] {exc} (set --metrics-address, or 0 to serve no metrics)")
        return EXIT_INIT
    stop, reload = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    label.watch(stop, reload)
    log.info("kubegpu node starting (%s mode, plugin dir %s)", "standalone" if args.standalone else "cluster",
             options.plugin_dir)
    code = run_daemon(daemon, stop=stop, reload=reload, run_for=args.run_for)
    backend.close()
    return code


# The command's own options as `kubegpu.cli.node.node_command` declares them (a test keeps the two equal).
FLAGS = {"--standalone": "standalone", "--dry-run": "dry_run", "--json": "as_json"}
VALUES = {"--inventory": "inventory", "--node-name": "node_name", "--kubeconfig": "kubeconfig",
          "--run-for": "run_for", "--log-level": "log_level", "--kubelet-plugin": "kubelet_plugin"}
ENVS = {"node_name": "NODE_NAME", "kubeconfig": "KUBECONFIG", "kubelet_plugin": "KUBEGPU_KUBELET_PLUGIN"}
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def parse_node_argv(argv: Sequence[str], environ: Mapping[str, str]) -> NodeArgs | None:
    """``kubegpu node``'s arguments as click reads them for the typer command, or None where this reader
    does not take them as they are (help, ``--``, a short option, an option without its value, a value
    that is not a plain number of seconds ...): the typer command then decides, with its own messages.

    As click does there: the command's options may come anywhere and the last occurrence wins, an option's
    value may follow as the next argument or after ``=``, everything else (NVIDIA's flags and their
    values) is kept in order for :func:`parse_extra_flags`, and an unset option falls back to its
    environment variable when that is not empty."""
    got: dict[str, Any] = {}
    extra: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        name, eq, value = a.partition("=")
        if a.startswith("-") and (not a.startswith("--") or a == "--" or name == "--help"):
            return None
        if name in FLAGS:
            if eq:
                return None  # click: "option does not take a value"
            got[FLAGS[name]] = True
        elif name in VALUES:
            if not eq:
                if i >= len(argv) or argv[i].startswith("-"):
                    return None
                value = argv[i]
                i += 1
            got[VALUES[name]] = value
        else:
            extra.append(a)
    for key, var in ENVS.items():
        if key not in got and environ.get(var):
            got[key] = environ[var]
    if "run_for" in got:
        if not _SECONDS.fullmatch(got["run_for"]):
            return None
        got["run_for"] = float(got["run_for"])
    return NodeArgs(extra=tuple(extra), **got)


def lean_main(argv: Sequence[str]) -> int | None:
    """Run ``kubegpu node <argv>`` and return its exit code, or None to leave ``argv`` to the typer command."""
    args = parse_node_argv(argv, os.environ)
    if args is None:
        return None
    try:
        return run_node(args)
    except (EOFError, KeyboardInterrupt):  # as click ends a command interrupted before its handlers are set
        print("\nAborted!", file=sys.stderr)
        return 1
