"""``kubegpu status`` / ``kubectl gpu``: per node and per GPU, who holds what, and how fragmented it is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app
from kubegpu.model.quantity import format_bytes
from kubegpu.status.view import ClusterView, build_view


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}Gi"


def render_table(view: ClusterView) -> Group:
    """The status as rich renderables: one row per GPU, then the cluster totals."""
    table = Table(title="GPUs", expand=False)
    for col in ("NODE", "GPU", "MODEL", "HEALTH", "COMPUTE", "MEMORY", "HELD BY"):
        table.add_column(col, overflow="fold")
    for node in view.nodes:
        for i, g in enumerate(node.gpus):
            health = "[green]Healthy[/]" if g.healthy else "[red]Unhealthy[/]"
            core = f"{g.core_used} %"
            if g.core_used > 100:
                core = f"[red]{core}[/]"
            elif g.partial:
                core = f"[yellow]{core}[/]"
            # Escaped: "pod[container]" would otherwise be read as rich markup and the container vanish.
            holders = escape(", ".join(
                f"{h.pod}" + (f"[{h.container}]" if h.container else "") + f" {h.core}%/{format_bytes(h.memory_bytes)}"
                for h in g.holders
            )) or "-"
            table.add_row(node.name if i == 0 else "", str(g.index), g.model or "-", health, core,
                          f"{_gib(g.memory_used)}/{_gib(g.memory_bytes)}", holders,
                          end_section=i == len(node.gpus) - 1)
    t = view.totals
    totals = Table.grid(padding=(0, 2))
    totals.add_row("nodes", str(t.nodes), "GPUs", f"{t.gpus} ({t.healthy_gpus} healthy)")
    totals.add_row("allocated", f"{t.allocated_gpu:.2f} GPU ({t.allocated_pct:.1f} %)",
                   "free", f"{t.free_gpu:.2f} GPU ({t.whole_free_gpus} whole)")
    totals.add_row("stranded", f"{t.stranded_gpu:.2f} GPU ({t.stranded_pct:.1f} %)", "", "")
    parts: list = [table, totals]
    for p in view.problems:
        parts.append(f"[red]problem:[/] {p}")
    return Group(*parts)


@app.command("status", short_help="Show every GPU: who holds it, how full, how fragmented.")
def status(
    kubeconfig: Path | None = typer.Option(None, envvar="KUBECONFIG", metavar="FILE",
                                           help="kubeconfig (default: in-cluster "
                                           "credentials or ~/.kube/config)."),
    extender: str | None = typer.Option(None, metavar="URL",
                                        help="Read the extender's debug API at this base URL instead "
                                        "of the API server (e.g. http://127.0.0.1:12345)."),
    node: str | None = typer.Option(None, metavar="NAME", help="Show only this node."),
    model: str | None = typer.Option(None, metavar="TEXT",
                                     help="Show only GPUs whose model contains this text (e.g. A100)."),
    namespace: str | None = typer.Option(None, "--namespace", "-n", metavar="NAME",
                                         help="Show only GPUs free or held by pods of this namespace."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place until interrupted."),
    interval: float = typer.Option(2.0, metavar="SECONDS", help="Seconds between refreshes with --watch."),
    count: int = typer.Option(0, metavar="N", help="With --watch, stop after this many refreshes (0 = forever)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (for scripts)."),
) -> None:
    """Show every GPU: model, health, compute and memory allocated, which pods hold it, and the
    cluster's totals, including stranded (fragmented) GPU: free compute on partly used GPUs that no
    whole-GPU request can use."""
    from kubegpu.status.sources import SourceError, from_api_server, from_extender

    client = None

    def snapshot() -> ClusterView:
        nonlocal client
        if extender:
            inventories, records, problems = from_extender(extender)
        else:
            if client is None:
                from kubegpu.kube.client import ClientConfigError, make_client

                try:
                    client = make_client(kubeconfig)
                except ClientConfigError as exc:
                    raise SourceError(str(exc)) from None
            inventories, records, problems = from_api_server(client)
        view = build_view(inventories, records, node=node, model=model, namespace=namespace)
        return ClusterView(view.nodes, view.totals, tuple(problems) + view.problems)

    console = make_console()  # piped output is read by scripts and pagers: never fold rows
    try:
        if as_json:
            typer.echo(json.dumps(snapshot().to_json()))
            return
        if not watch:
            console.print(render_table(snapshot()))
            return
        from rich.live import Live

        with Live(render_table(snapshot()), console=console, refresh_per_second=4) as live:
            n = 1
            while count == 0 or n < count:
                time.sleep(interval)
                live.update(render_table(snapshot()))
                n += 1
    except SourceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
