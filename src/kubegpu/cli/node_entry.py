"""``kubegpu node``: its command line, and the node process from its environment to its exit code.

The node daemon lives on every GPU node for the node's lifetime, within a memory budget close to NVIDIA's
plugin's, so this entry loads no CLI framework: the command line is read by argparse (standard library), the
command's own options declared here and every configuration flag made from the node config's option table
(:func:`kubegpu.node.config.argv.add_config_arguments`), which ``--help`` prints with its environment
variables. ``kubegpu.cli.main.main`` hands a process started as ``kubegpu node`` straight to :func:`main`;
the typer app's ``node`` command (``kubegpu.cli.node``) only forwards its arguments here.

This is the only place the node reads its process environment: :func:`main` takes it once and passes it to
everything that needs a variable (the config loader, the node label, the backend).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kubegpu.node.lifecycle import EXIT_CONFIG, EXIT_INIT, EXIT_OK

log = logging.getLogger("kubegpu.node")

KUBELET_PLUGINS = ("device-plugin", "dra")
LOG_LEVELS = ("debug", "info", "warning", "error")

# (inventory or None, node name or None, the driver root as mounted here, the environment) -> a backend
BackendFactory = Callable[[str | None, str | None, str | None, Mapping[str, str]], Any]


def default_backend(inventory: str | None, node_name: str | None, driver_root: str | None,
                    env: Mapping[str, str]) -> Any:
    """A topology file's GPUs (``--inventory``), else NVML's, loaded from the host's driver root where it is
    mounted in this container (as NVIDIA's plugin finds it), else from the library path."""
    if inventory:
        from kubegpu.inventory.fake import FakeBackend

        return FakeBackend(inventory, node_name=node_name)
    try:
        from kubegpu.inventory.nvml import NvmlBackend  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError(f"the NVML backend is not available ({exc}); use --inventory for a topology file") \
            from None
    return NvmlBackend(node_name=node_name, driver_root=driver_root, env=env)


@dataclass(frozen=True)
class NodeArgs:
    """``kubegpu node``'s command line: the command's own options, and the configuration flags given
    (flag name -> value as typed) for the config loader."""

    standalone: bool = False
    inventory: str | None = None
    node_name: str | None = None
    kubeconfig: str | None = None
    dry_run: bool = False
    as_json: bool = False
    run_for: float | None = None
    log_level: str = "info"
    kubelet_plugin: str = "device-plugin"
    config_flags: Mapping[str, str] = field(default_factory=dict)


class UsageError(ValueError):
    """A command line ``kubegpu node`` cannot take; the message says what is wrong."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # raised, so a caller (the demo) can say which node it was
        raise UsageError(message)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return value


def node_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser of ``kubegpu node``; options with an environment variable default to it when it is set."""
    from kubegpu.node.config.argv import add_config_arguments

    def from_env(name: str) -> str | None:
        return env.get(name) or None  # an empty variable counts as unset

    p = _Parser(
        prog="kubegpu node", usage="kubegpu node [options]", allow_abbrev=False,
        description="Serve this node's GPUs to the kubelet (device plugins, or a DRA driver with --kubelet-plugin "
                    "dra), watch their health, export metrics and probes. Takes NVIDIA's device-plugin flags, "
                    "environment variables and config file unchanged: each configuration option below is also read "
                    "from the environment variable named and from the config file (flag > environment > file > "
                    "default). SIGHUP reloads the config, SIGTERM stops; exit codes: 0 stopped, 1 init failure, "
                    "2 bad configuration.")
    own = p.add_argument_group("kubegpu node")
    own.add_argument("--standalone", action="store_true",
                     help="run without an API server (node-only mode, a drop-in for NVIDIA's plugin)")
    own.add_argument("--inventory", metavar="TOPOLOGY",
                     help="a topology file or shipped name (dgx-a100, dgx1-v100, ...) instead of NVML")
    own.add_argument("--node-name", metavar="NAME", default=from_env("NODE_NAME"),
                     help="this node's name [env NODE_NAME]")
    own.add_argument("--kubeconfig", metavar="FILE", default=from_env("KUBECONFIG"),
                     help="kubeconfig for full mode (in-cluster credentials otherwise) [env KUBECONFIG]")
    own.add_argument("--dry-run", action="store_true", help="print the resources that would be served, then exit")
    own.add_argument("--json", dest="as_json", action="store_true", help="with --dry-run: JSON output for scripts")
    own.add_argument("--run-for", metavar="SECONDS", type=_seconds, help="stop by itself after this many seconds")
    own.add_argument("--log-level", metavar="LEVEL", default="info", type=str.lower, choices=LOG_LEVELS,
                     help=", ".join(LOG_LEVELS))
    own.add_argument("--kubelet-plugin", metavar="KIND",
                     default=from_env("KUBEGPU_KUBELET_PLUGIN") or KUBELET_PLUGINS[0],
                     help="device-plugin, or dra (Kubernetes 1.34+: ResourceSlices and claims) "
                          "[env KUBEGPU_KUBELET_PLUGIN]")
    add_config_arguments(p)
    return p


def parse_node_args(argv: Sequence[str], env: Mapping[str, str]) -> NodeArgs:
    """``kubegpu node <argv>`` read; raises :class:`UsageError` (``--help`` prints the help and exits 0)."""
    parser = node_parser(env)
    ns, rest = parser.parse_known_args(list(argv))
    if rest:
        first = rest[0]
        parser.error(f"{first.partition('=')[0]}: unknown flag (kubegpu node --help lists them)"
                     if first.startswith("-") else f"unexpected argument {first!r} (options look like --name value)")
    if ns.kubelet_plugin not in KUBELET_PLUGINS:
        parser.error(f"--kubelet-plugin {ns.kubelet_plugin!r}: expected device-plugin or dra")
    values = vars(ns)
    return NodeArgs(config_flags=values.pop("config_flags") or {},
                    **{k: v for k, v in values.items() if k in NodeArgs.__dataclass_fields__})


def _fail(prefix: str, exc: BaseException) -> None:
    print(f"{prefix}: {exc}", file=sys.stderr)


def _print_plans(plans: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"resource": p.name, "socket": p.socket_name, "devices": [d.id for d in p.devices],
                           "sharing": p.sharing, "replicas": p.replicas} for p in plans]))
        return
    from rich.table import Table

    from kubegpu.cli.console import make_console

    table = Table(title="resources")
    for col in ("resource", "socket", "devices", "sharing"):
        table.add_column(col)
    for p in plans:
        table.add_row(p.name, p.socket_name, str(len(p.devices)),
                      p.sharing + (f" x{p.replicas}" if p.shared else ""))
    make_console(stderr=True).print(table)


def run_node(args: NodeArgs, env: Mapping[str, str], backend_factory: BackendFactory = default_backend) -> int:
    """Serve this node's GPUs until stopped; the exit code (0 clean stop, 1 init failure, 2 bad configuration).

    The configuration is loaded once here, with the ``config.map`` entry the node's label selects, and each
    part of the node is built from that one :class:`~kubegpu.node.config.Config`."""
    from kubegpu.node.config import ConfigError
    from kubegpu.node.config.source import ConfigSource, NodeConfigLabel

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    in_cluster = bool(env.get("KUBERNETES_SERVICE_HOST"))
    label = NodeConfigLabel(None if args.standalone or not (args.kubeconfig or in_cluster) else args.kubeconfig or "",
                            args.node_name or "")
    source = ConfigSource(args.config_flags, env, label.read)
    try:
        config = source.load()
    except ConfigError as exc:
        _fail("configuration error", exc)
        return EXIT_CONFIG
    try:
        backend = backend_factory(args.inventory, args.node_name, config.flags.plugin.container_driver_root, env)
    except Exception as exc:
        _fail("error", exc)
        return EXIT_INIT
    try:
        if args.kubelet_plugin == "dra":  # the node serves its GPUs through DRA only (never both ways)
            return _run_dra(args, config, backend, env)
        return _run_device_plugins(args, source, config, backend, label, env)
    finally:
        backend.close()


def _run_dra(args: NodeArgs, config: Any, backend: Any, env: Mapping[str, str]) -> int:
    from kubegpu.node.dra.cli import dra_options, print_slices
    from kubegpu.node.lifecycle import Controls, run

    try:
        inv = backend.discover()
        options = dra_options(config, args.node_name or inv.name)
    except ValueError as exc:  # the DRA settings (discovery fails with InventoryError, a RuntimeError)
        _fail("configuration error", exc)
        return EXIT_CONFIG
    except Exception as exc:
        _fail("error: discovery failed", exc)
        return EXIT_INIT
    if args.dry_run:
        print_slices(inv, options, args.as_json)
        return EXIT_OK
    from kubegpu.kube.client import make_client
    from kubegpu.node.dra.daemon import DraDaemon
    from kubegpu.node.metrics import NodeMetrics

    try:
        client = make_client(args.kubeconfig)
    except Exception as exc:
        _fail("error: the DRA driver needs the API server (claims, ResourceSlices)", exc)
        return EXIT_INIT
    metrics = NodeMetrics()
    controls = Controls()
    controls.install_signals()
    return run(DraDaemon(backend, options, client, metrics=metrics, env=env), controls, metrics=metrics,
               metrics_address=config.kubegpu.metrics_address, run_for=args.run_for)


def _run_device_plugins(args: NodeArgs, source: Any, config: Any, backend: Any, label: Any,
                         env: Mapping[str, str]) -> int:
    from kubegpu.node.daemon import NodeDaemon, NodeOptions
    from kubegpu.node.lifecycle import Controls, run
    from kubegpu.node.metrics import NodeMetrics
    from kubegpu.node.options import node_options

    if args.dry_run:
        try:
            plans = list(node_options(config).expand(backend.discover()))
        except Exception as exc:
            _fail("error", exc)
            return EXIT_INIT
        _print_plans(plans, args.as_json)
        return EXIT_OK

    metrics = NodeMetrics()
    publisher = resolver = None
    if not args.standalone:
        try:
            publisher, resolver = _cluster_seams(args.kubeconfig, args.node_name or backend.discover().name,
                                                 config, metrics.registry, env)
        except Exception as exc:
            _fail("error", exc)
            return EXIT_INIT

    pending = [config]  # loaded above: the daemon's first call takes it

    def load_options() -> NodeOptions:
        # A reload loads the whole config again (the node label may name another entry now), and the GFD
        # labels the publisher writes follow the same config as the plugins the daemon serves.
        whole = pending.pop() if pending else source.load()
        if publisher is not None:
            publisher.configure(whole)
        return node_options(whole)

    daemon = NodeDaemon(backend, load_options, publisher=publisher, resolver=resolver, metrics=metrics, env=env)
    controls = Controls()
    controls.install_signals()
    label.watch(controls.stop, controls.ask_reload)
    log.info("kubegpu node starting (%s mode, plugin dir %s)", "standalone" if args.standalone else "cluster",
             daemon.options.plugin_dir)
    return run(daemon, controls, metrics=metrics, metrics_address=config.kubegpu.metrics_address,
               run_for=args.run_for)


def _cluster_seams(kubeconfig: str | None, node_name: str, config: Any, registry: Any,
                   env: Mapping[str, str]) -> tuple[Any, Any]:
    """(publisher, resolver) for full mode, with the record key and the declared GPU resource names of the
    node's environment; raises RuntimeError without credentials."""
    try:
        from kubegpu.kube.client import make_client
    except ImportError as exc:
        raise RuntimeError(f"the Kubernetes adapter is not available ({exc}); run with --standalone") from None
    try:
        client = make_client(kubeconfig)
    except Exception as exc:
        raise RuntimeError(f"no Kubernetes credentials ({exc}); give --kubeconfig, run in-cluster, "
                           "or use --standalone") from None
    from kubegpu.model.resources import declared_gpu_resources
    from kubegpu.model.signing import load_key
    from kubegpu.node.handoff import make_resolver
    from kubegpu.node.publish.kube import KubeNodePublisher

    publisher = KubeNodePublisher(client, node_name, config)
    resolver = make_resolver(client, node_name, pod_resources_socket=config.kubegpu.pod_resources_socket,
                             registry=registry, key=load_key(env), gpu_resources=declared_gpu_resources(env))
    return publisher, resolver


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         backend_factory: BackendFactory = default_backend) -> int:
    """``kubegpu node <argv>`` (default: this process's arguments past ``node``) under ``env`` (default:
    this process's environment, read here and nowhere else); the exit code."""
    environ: Mapping[str, str] = dict(os.environ) if env is None else env
    try:
        args = parse_node_args(sys.argv[2:] if argv is None else argv, environ)
    except UsageError as exc:
        print(f"usage: kubegpu node [options] (--help lists them)\nkubegpu node: error: {exc}",
              file=sys.stderr)
        return EXIT_CONFIG
    try:
        return run_node(args, environ, backend_factory)
    except KeyboardInterrupt:  # before the signal handlers are in place
        print("\nAborted!", file=sys.stderr)
        return 1
