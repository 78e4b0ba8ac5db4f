"""``kubegpu status`` / ``kubectl gpu``: per node and per GPU, who holds what, and how fragmented it is."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app
from kubegpu.cli.output import output_format, print_data
from kubegpu.model.quantity import format_bytes
from kubegpu.status.view import ClusterView, GpuView, Holder


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}Gi"


def _holders(holders: tuple[Holder, ...]) -> str:
    # Escaped: "pod[container]" would otherwise be read as rich markup and the container vanish.
    return escape(", ".join(
        f"{h.pod}" + (f"[{h.container}]" if h.container else "") + f" {h.core}%/{format_bytes(h.memory_bytes)}"
        for h in holders
    )) or "-"


def _gpu_row(g: GpuView) -> tuple[str, str]:
    """COMPUTE and HELD BY of one GPU row."""
    if g.mig_enabled:
        profiles = Counter(m.profile for m in g.mig)
        layout = ", ".join(f"{p} ×{n}" if n > 1 else p for p, n in profiles.items()) or "no devices"
        free = sum(1 for m in g.mig if m.healthy and not m.holders)
        return "MIG", f"MIG: {layout}; {free} of {len(g.mig)} free (see MIG layout)"
    core = f"{g.core_used} %"
    if g.core_used > 100:
        core = f"[red]{core}[/]"
    elif g.partial:
        core = f"[yellow]{core}[/]"
    if g.replica_only:
        return core, "time-slicing / MPS replicas only (see replicas)"
    return core, _holders(g.holders)


def _mig_table(view: ClusterView) -> Table | None:
    rows = [(n, g) for n in view.nodes for g in n.gpus if g.mig_enabled]
    if not rows:
        return None
    table = Table(title="MIG layout", expand=False)
    for col in ("NODE", "GPU", "MIG", "PROFILE", "SLICES", "MEMORY", "HEALTH", "HELD BY"):
        table.add_column(col, overflow="fold")
    for i, (n, g) in enumerate(rows):
        first_of_node = i == 0 or rows[i - 1][0].name != n.name
        for j, m in enumerate(g.mig):
            health = "[green]Healthy[/]" if m.healthy else "[red]Unhealthy[/]"
            table.add_row(n.name if first_of_node and j == 0 else "", str(g.index) if j == 0 else "",
                          str(m.index), m.profile, "■" * m.slices if m.slices else "?", format_bytes(m.memory_bytes),
                          health, _holders(m.holders) if m.holders else "[dim]free[/]", end_section=j == len(g.mig) - 1)
        if not g.mig:
            table.add_row(n.name if first_of_node else "", str(g.index), "-", "-", "-", "-", "-",
                          "MIG enabled, no devices", end_section=True)
    return table


def _replica_table(view: ClusterView) -> Table | None:
    rows = [(n, r) for n in view.nodes for r in n.replicas]
    if not rows:
        return None
    table = Table(title="Time-slicing / MPS replicas (counted by the kubelet)", expand=False)
    for col in ("NODE", "RESOURCE", "GPUS", "PER GPU", "HELD", "HELD BY"):
        table.add_column(col, overflow="fold")
    for n, r in rows:
        holders = escape(", ".join(f"{h.pod}[{h.container}]" + (f" ×{h.count}" if h.count > 1 else "")
                                   for h in r.holders)) or "-"
        table.add_row(n.name, r.resource, str(r.gpus) if r.per_gpu else "?", str(r.per_gpu) if r.per_gpu else "?",
                      f"{r.held}/{r.total}", holders)
    return table


def source_notes(view: ClusterView, extender: bool) -> list[str]:
    """What the chosen source cannot see, so a reader knows which view is behind where the two differ."""
    if not extender:
        return []
    notes = ["time-slicing / MPS replicas are counted by the kubelet, not the extender: they are shown from "
             "the API server only (drop --extender)"]
    if any(g.uuid.startswith("minor-") for n in view.nodes for g in n.gpus):
        notes.append("this extender's summary has no deviceInfo (it predates this CLI): models, MIG devices and "
                     "replicated GPUs are unknown and health is read from each GPU's total; read the API "
                     "server (drop --extender) for those")
    return notes


def _enforcement(g: GpuView) -> str:
    """The SHARES cell: the mode, and under strict the compute mode and the shape lock; "escapable" where a
    container could take more than its share."""
    parts = [g.share_enforcement or "-"]
    if g.compute_mode:
        parts.append(g.compute_mode)
    if g.shape_lock:
        parts.append(f"locked to {g.shape_lock}")
    if g.escapable:
        parts.append("escapable")
    return ", ".join(parts)


def render_table(view: ClusterView, *, wide: bool = False, notes: list[str] | None = None) -> Group:
    """The status as rich renderables: one row per GPU, the MIG layout and the replicas, then the totals."""
    table = Table(title="GPUs", expand=False)
    for col in ("NODE", "GPU", "MODEL", "HEALTH", "COMPUTE", "MEMORY", "SHARES", "HELD BY",
                *(("MINOR", "UUID") if wide else ())):
        table.add_column(col, overflow="fold")
    for node in view.nodes:
        for i, g in enumerate(node.gpus):
            health = "[green]Healthy[/]" if g.healthy else "[red]Unhealthy[/]"
            core, held = _gpu_row(g)
            table.add_row(node.name if i == 0 else "", str(g.index), g.model or "-", health, core,
                          f"{_gib(g.memory_used)}/{_gib(g.memory_bytes)}",
                          escape(_enforcement(g)), held,
                          *((str(g.minor), g.uuid) if wide else ()), end_section=i == len(node.gpus) - 1)
    t = view.totals
    totals = Table.grid(padding=(0, 2))
    totals.add_row("nodes", str(t.nodes), "GPUs", f"{t.gpus} ({t.healthy_gpus} healthy)")
    totals.add_row("allocated", f"{t.allocated_gpu:.2f} GPU ({t.allocated_pct:.1f} %)",
                   "free", f"{t.free_gpu:.2f} GPU ({t.whole_free_gpus} whole)")
    totals.add_row("stranded", f"{t.stranded_gpu:.2f} GPU ({t.stranded_pct:.1f} %)", "", "")
    if t.replicas_total or t.replica_pods:
        pods = f"{t.replica_pods} pod" + ("" if t.replica_pods == 1 else "s")
        totals.add_row("replicas", f"{t.replicas_held}/{t.replicas_total} held ({pods})",
                       "on", f"{t.replica_gpus} GPUs offered only as replicas")
    if t.mig_devices:
        totals.add_row("MIG devices", f"{t.mig_devices} ({t.mig_devices_free} free)", "", "")
    parts: list = [table]
    for extra in (_mig_table(view), _replica_table(view)):
        if extra is not None:
            parts.append(extra)
    parts.append(totals)
    for p in view.problems:
        parts.append(f"[red]problem:[/] {escape(p)}")
    for note in notes or ():
        parts.append(f"[yellow]note:[/] {escape(note)}")
    return Group(*parts)


@app.command("status", short_help="Show every GPU: who holds it, how full, how fragmented.")
def status(
    kubeconfig: Path | None = typer.Option(None, envvar="KUBECONFIG", metavar="FILE",
                                           help="kubeconfig (default: in-cluster "
                                           "credentials or ~/.kube/config)."),
    extender: str | None = typer.Option(None, metavar="URL",
                                        help="Read the extender's debug API at this base URL instead "
                                        "of the API server (e.g. http://127.0.0.1:8888 through "
                                        "`kubectl port-forward`). HTTPS is verified."),
    extender_ca: str | None = typer.Option(None, "--extender-ca", metavar="FILE",
                                           help="CA bundle (PEM) that signed the "
                                           "extender's HTTPS certificate (default: the system's)."),
    node: str | None = typer.Option(None, metavar="NAME", help="Show only this node."),
    model: str | None = typer.Option(None, metavar="TEXT",
                                     help="Show only GPUs whose model contains this text (e.g. A100)."),
    namespace: str | None = typer.Option(None, "--namespace", "-n", metavar="NAME",
                                         help="Show only GPUs free or held by pods of this namespace."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place until interrupted."),
    interval: float = typer.Option(2.0, metavar="SECONDS", help="Seconds between refreshes with --watch."),
    count: int = typer.Option(0, metavar="N", help="With --watch, stop after this many refreshes (0 = forever)."),
    output: str = typer.Option("", "--output", "-o", metavar="FORMAT",
                               help="json, yaml, or wide (adds each GPU's UUID and minor); default: the table."),
    as_json: bool = typer.Option(False, "--json", help="Same as -o json."),
) -> None:
    """Show every GPU: model, health, compute and memory allocated, which pods hold it, and the
    cluster's totals, including stranded (fragmented) GPU: free compute on partly used GPUs that no
    whole-GPU request can use."""
    from kubegpu.status.reservations import reservations_from_extender, reservations_table
    from kubegpu.status.sources import SourceError, from_api_server, from_extender

    fmt = output_format(output or ("json" if as_json else ""))
    client = None

    def snapshot() -> ClusterView:
        nonlocal client
        if extender:
            snap = from_extender(extender, ca=extender_ca)
        else:
            if client is None:
                from kubegpu.kube.client import ClientConfigError, make_client

                try:
                    client = make_client(kubeconfig)
                except ClientConfigError as exc:
                    raise SourceError(str(exc)) from None
            snap = from_api_server(client, os.environ)
        names = sorted(i.name for i in snap.inventories)
        if node is not None and node not in names:
            raise SourceError(f"no node {node!r} with GPUs in {'the extender' if extender else 'the cluster'} "
                              f"(nodes: {', '.join(names) or 'none'})")
        return snap.view(node=node, model=model, namespace=namespace)

    def data() -> dict[str, Any]:
        view = snapshot()
        out = {**view.to_json(), "source": "extender" if extender else "api-server",
               "notes": source_notes(view, extender is not None)}
        if extender:  # only the extender knows them
            out["reservations"] = reservations_from_extender(extender, ca=extender_ca)
        return out

    console = make_console()  # piped output is read by scripts and pagers: never fold rows
    try:
        if fmt in ("json", "yaml"):
            print_data(data(), fmt)
            return

        def table() -> Group:
            view = snapshot()
            out = render_table(view, wide=fmt == "wide", notes=source_notes(view, extender is not None))
            held = reservations_from_extender(extender, ca=extender_ca) if extender else None
            extra = reservations_table(held) if held is not None else None
            return out if extra is None else Group(out, extra)

        if not watch:
            console.print(table())
            return
        from rich.live import Live

        with Live(table(), console=console, refresh_per_second=4) as live:
            n = 1
            while count == 0 or n < count:
                time.sleep(interval)
                live.update(table())
                n += 1
    except SourceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
