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

This module is the typer command (its options, ``--help``); what it runs is
:func:`kubegpu.cli.node_entry.run_node`, which a process started as ``kubegpu node`` reaches
without loading typer at all (:func:`kubegpu.cli.node_entry.lean_main`).
"""

from __future__ import annotations

from typing import Any

import typer

from kubegpu.cli.main import app
from kubegpu.cli.node_entry import (
    EXIT_CONFIG,
    EXIT_INIT,
    EXIT_OK,
    NodeArgs,
    NodeConfigLabel,
    _backend,
    parse_extra_flags,
    run_daemon,
    run_node,
)

# What runs lives in kubegpu.cli.node_entry (no typer, for the lean entry); callers and the demo keep
# using these names from here.
__all__ = ["EXIT_CONFIG", "EXIT_INIT", "EXIT_OK", "NodeConfigLabel", "_backend", "node_command",
           "parse_extra_flags", "run_daemon"]

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
    # The lean entry (kubegpu.cli.node_entry.lean_main) reads these same options without typer; both run this.
    # `_backend` is looked up here, at call time: the demo replaces it on this module.
    raise typer.Exit(run_node(NodeArgs(standalone=standalone, inventory=inventory, node_name=node_name,
                                       kubeconfig=kubeconfig, dry_run=dry_run, as_json=as_json, run_for=run_for,
                                       log_level=log_level, kubelet_plugin=kubelet_plugin, extra=tuple(ctx.args)),
                              _backend))
