"""``kubegpu simulate``: the capacity planner. Replays a GPU cluster trace through placement policies."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kubegpu.cli.main import app

DEFAULT_SEEDS_NOTE = "one seed by default; the paper's study is --seeds 10"
# kubegpu.placement.policies.POLICY_NAMES, written out so `--help` does not import placement (a test keeps the
# two the same).
POLICIES_IN_HELP = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "spread", "kubegpu", "dra")
# The FGD paper's published values (PAPER_AT_100) are for its default trace: these packaged node and pod lists.
PAPER_TRACE = ("openb_node_list_gpu_node.csv", "openb_pod_list_default.csv")


@app.command("simulate", short_help="Replay a GPU cluster trace through the placement policies.")
def simulate(
    nodes: Annotated[
        Path | None,
        typer.Option(
            "--nodes", metavar="CSV",
            help="openb-format node list (default: the packaged Alibaba openb GPU node list, 1,213 nodes)."
        ),
    ] = None,
    pods: Annotated[
        Path | None,
        typer.Option(
            "--pods", metavar="CSV",
            help="openb-format pod list (default: the packaged openb_pod_list_default.csv, 8,152 pods)."
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            metavar="POLICY",
            help="Node-level policy; repeat for "
            "several (default: the six FGD-paper policies and kubegpu). "
            "Known: " + ", ".join(POLICIES_IN_HELP) + " (dra: the stock kube-scheduler with DRA claims).",
        ),
    ] = None,
    gpu_policy: Annotated[
        str | None,
        typer.Option("--gpu-policy", metavar="POLICY",
                     help="GPU-level policy for every run (default: each node policy's own pairing)."),
    ] = None,
    seeds: Annotated[
        int,
        typer.Option("--seeds", min=1, max=1000, metavar="N",
                     help="Seeds per policy (42, 43, ...); " + DEFAULT_SEEDS_NOTE + "."),
    ] = 1,
    inflate: Annotated[
        float | None,
        typer.Option(
            "--inflate",
            min=0.1,
            max=10.0,
            metavar="X",
            help="Resample pods until the GPU request reaches this multiple of capacity (default 1.3; "
            "not with --replay-time).",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (last line) instead of a table.")
    ] = False,
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="json", help="json: the same as --json.")
    ] = "",
    plot: Annotated[Path | None, typer.Option("--plot", metavar="PNG",
                                              help="Write the paper's figure 9a (PNG).")] = None,
    replay_time: Annotated[
        bool,
        typer.Option(
            "--replay-time", help="Replay creation/deletion timestamps with departures instead of the paper's protocol."
        ),
    ] = False,
    learned_workload: Annotated[
        bool,
        typer.Option(
            "--learned-workload",
            help="Score with the target workload learned online from the pods placed so far (as the "
            "extender learns it) instead of the pod list's.",
        ),
    ] = False,
    ties: Annotated[
        str,
        typer.Option("--ties", metavar="random|name",
                     help="Ties between equal nodes: a random node order per seed (the paper's) or node name "
                     "(the extender's)."),
    ] = "random",
    load: Annotated[
        str,
        typer.Option(
            "--load",
            metavar="FACTOR|auto",
            help="With --replay-time: compress the time between arrivals by this factor (pods keep their "
            "durations), or 'auto' (default): the factor that brings the peak concurrent GPU request to 95 % "
            "of capacity, so policies meet contention. 1 replays the recorded times.",
        ),
    ] = "auto",
    reservations: Annotated[
        bool,
        typer.Option(
            "--reservations",
            help="With --replay-time: pods that fit nowhere wait in a queue instead of being dropped, and each "
            "policy runs twice, without and with reservations for wide pods; reports waits per pod width, "
            "pods never placed and the GPU-hours reservations left idle.",
        ),
    ] = False,
    reserve_min_gpus: Annotated[
        int, typer.Option("--reserve-min-gpus", min=1, max=64, metavar="N",
                          help="With --reservations: a pod asking N or more whole GPUs is wide (default 4).")
    ] = 4,
    reserve_wait: Annotated[
        float, typer.Option("--reserve-wait", min=0.0, metavar="SECONDS",
                            help="With --reservations: a wide pod gets a reservation after waiting this long "
                            "(default 60).")
    ] = 60.0,
    reserve_max_share: Annotated[
        float, typer.Option("--reserve-max-share", min=0.0, max=1.0, metavar="FRACTION",
                            help="With --reservations: reservations hold at most this fraction of the GPUs "
                            "(default 0.25).")
    ] = 0.25,
    times_from: Annotated[
        Path | None,
        typer.Option("--times-from", metavar="CSV",
                     help="With --replay-time: pods without creation/deletion times take those of this list's "
                     "pod of the same name, else of one of its pods of the same GPU count (the paper's "
                     "multigpuNN and other variant lists carry no times; give openb_pod_list_default.csv).")
    ] = None,
    include_cpu_nodes: Annotated[
        bool, typer.Option("--include-cpu-nodes", help="Keep nodes without GPUs (the paper uses GPU nodes only).")
    ] = False,
) -> None:
    """Replay a GPU cluster trace through kubegpu's placement policies and show how much GPU each strands.

    With no arguments: the packaged Alibaba openb trace (1,213 GPU nodes, 6,212 GPUs, 8,152 pods, resampled
    to 130 % of GPU capacity) through the six FGD-paper policies and kubegpu, ONE seed each (about a minute
    on a small machine). The full study of the paper is --seeds 10. Metric: unallocated GPU % (100 -
    allocated) when the arrived GPU request reaches 80 ... 130 % of capacity.
    """
    from kubegpu.cli.output import output_format
    from kubegpu.placement.policies import PAPER_POLICIES, POLICY_NAMES
    from kubegpu.sim.trace import TraceError, default_path, load_nodes, load_pods, with_times_from

    as_json = as_json or output_format(output, ("json",)) == "json"
    if plot is not None:
        _check_plot(plot, as_json)  # before minutes of replay, not after
    policies = list(policy) if policy else [*PAPER_POLICIES, "kubegpu"]
    unknown = [p for p in [*policies, *([gpu_policy] if gpu_policy else [])] if p not in POLICY_NAMES]
    if unknown:
        _fail(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}", as_json)
    try:
        node_list = load_nodes(nodes)
        pod_list = load_pods(pods)
    except TraceError as exc:
        _fail(str(exc), as_json)
    if not include_cpu_nodes:
        node_list = node_list.gpu_only()
    if not node_list.names or node_list.total_gpus == 0:
        _fail("the node list has no GPU nodes", as_json)
    trace = {
        "nodes": str(nodes or default_path("openb_node_list_gpu_node.csv").name),
        "pods": str(pods or default_path("openb_pod_list_default.csv").name),
        "node_count": len(node_list.names),
        "gpus": node_list.total_gpus,
        "pod_list": len(pod_list),
        "mode": "replay-time" if replay_time else "paper",
        "inflate": inflate,
        "seeds": [] if replay_time else list(range(42, 42 + seeds)),
    }
    paper_trace = _is_packaged(nodes, PAPER_TRACE[0]) and _is_packaged(pods, PAPER_TRACE[1])
    if replay_time:
        if times_from is not None:
            try:
                pod_list = with_times_from(pod_list, load_pods(times_from))
            except TraceError as exc:
                _fail(str(exc), as_json)
            trace["times_from"] = str(times_from)
        if not any(p.creation >= 0 for p in pod_list):
            _fail("the pod list has no creation times to replay; give --times-from with a list that has them "
                  "(e.g. openb_pod_list_default.csv)", as_json)
        if inflate is not None:
            _fail("--inflate resamples pods for the paper's protocol; with --replay-time use --load", as_json)
        from kubegpu.sim.timeline import load_for_peak

        if load == "auto":
            factor = load_for_peak(pod_list, node_list.total_gpus * 1000)
        else:
            try:
                factor = float(load)
            except ValueError:
                factor = 0.0
            if not 1.0 <= factor <= 1e9:
                _fail(f"--load must be 'auto' or a number from 1 to 1e9, not {load!r}", as_json)
        trace["load"] = round(factor, 3)
        trace.pop("inflate", None)
        if reservations:
            from kubegpu.placement.reservations import ReservationConfig

            config = ReservationConfig(reserve_min_gpus, reserve_wait, reserve_max_share)
            trace["reservation"] = {"min_gpus": reserve_min_gpus, "wait_seconds": reserve_wait,
                                    "max_share": reserve_max_share}
            _run_reservations(node_list, pod_list, policies, gpu_policy, trace, config, as_json)
            return
        _run_timeline(node_list, pod_list, policies, gpu_policy, trace, as_json)
        return
    if load != "auto":
        _fail("--load applies to --replay-time only", as_json)
    if reservations:
        _fail("--reservations applies to --replay-time only", as_json)
    if ties not in ("random", "name"):
        _fail(f"--ties must be random or name, not {ties!r}", as_json)
    trace["workload"] = "learned" if learned_workload else "pod list"
    trace["ties"] = ties
    inflate = 1.3 if inflate is None else inflate
    trace["inflate"] = inflate
    _run_study(node_list, pod_list, policies, gpu_policy, seeds, inflate, trace, as_json, plot, paper_trace)


def _is_packaged(path: Path | None, name: str) -> bool:
    """The packaged trace file ``name``: not given, or a file with the same bytes (a copy of it)."""
    from kubegpu.sim.trace import default_path

    if path is None:
        return True
    packaged = default_path(name)
    try:
        return path.stat().st_size == packaged.stat().st_size and path.read_bytes() == packaged.read_bytes()
    except OSError:
        return False


def _check_plot(plot: Path, as_json: bool) -> None:
    """--plot's needs, checked before any work: matplotlib (the `sim` extra) and a directory to write to."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        _fail("--plot needs matplotlib, which is not installed: pip install 'kubegpu[sim]'", as_json)
    if not plot.parent.resolve().is_dir():
        _fail(f"--plot {plot}: the directory {plot.parent} does not exist", as_json)


def _fail(message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": message}))
    else:
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _progress_bar(as_json: bool) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kubegpu.cli.console import make_console

    console = make_console(stderr=True)
    if as_json or not console.is_terminal:
        return None
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _run_study(
    node_list: Any,
    pod_list: Any,
    policies: list[str],
    gpu_policy: str | None,
    seeds: int,
    inflate: float,
    trace: dict[str, Any],
    as_json: bool,
    plot: Path | None,
    paper_trace: bool = False,
) -> None:
    from kubegpu.sim.study import run_study, study_json

    bar = _progress_bar(as_json)
    tasks: dict[tuple[str, int], Any] = {}

    def progress(name: str, seed: int, done: int, total: int) -> None:
        if bar is None:
            return
        key = (name, seed)
        if key not in tasks:
            tasks[key] = bar.add_task(f"{name} seed {seed}", total=total)
        bar.update(tasks[key], completed=done)

    seed_list = list(range(42, 42 + seeds))
    if bar is not None:
        with bar:
            results = run_study(node_list, pod_list, policies, seed_list, inflate, gpu_policy, progress,
                                learned=trace["workload"] == "learned", ties=trace["ties"])
    else:
        results = run_study(node_list, pod_list, policies, seed_list, inflate, gpu_policy, progress,
                            learned=trace["workload"] == "learned", ties=trace["ties"])
    if plot is not None:
        from kubegpu.sim.plot import plot_study

        try:
            plot_study(results, plot, f"{trace['pods']} on {trace['node_count']} nodes, {seeds} seed(s)")
        except ImportError as exc:  # matplotlib is the `sim` extra
            typer.echo(f"error: --plot needs matplotlib ({exc}): pip install 'kubegpu[sim]'", err=True)
            raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(study_json(trace, results)))
        return
    _print_table(results, trace, seeds, plot, paper_trace)


def _target_width(console: Any) -> int | None:
    """The width a table must fit: COLUMNS when set (as in a script or CI), else the terminal's; None (no limit)
    for a pipe or a file without COLUMNS."""
    import os

    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    return console.width if console.is_terminal else None


def _fit(columns: list[tuple[str, str, list[str]]], keep: list[str], width: int | None) -> list[str]:
    """The headers of ``columns`` (header, justify, cells) to show: in ``keep``'s order of importance, each
    while the table still fits ``width`` (rich's box: one border per column plus one, padding 1 each side)."""
    if width is None:
        return [h for h, _, _ in columns]
    sizes = {h: max([len(h), *(len(c) for c in cells)]) + 3 for h, _, cells in columns}
    shown: list[str] = []
    used = 1
    for h in keep:
        if used + sizes[h] <= width or not shown:
            shown.append(h)
            used += sizes[h]
    return shown


def _table(title: str, columns: list[tuple[str, str, list[str]]], keep: list[str], width: int | None) -> Any:
    """A rich table of the columns that fit, in their own order; the dropped ones are named in the caption."""
    from rich.table import Table

    shown = _fit(columns, keep, width)
    dropped = [h for h, _, _ in columns if h not in shown]
    caption = f"not shown at {width} columns: {', '.join(dropped)} (--json has every value)" if dropped else None
    table = Table(title=title, caption=caption)
    picked = [(h, j, cells) for h, j, cells in columns if h in shown]
    for h, j, _ in picked:
        table.add_column(h, justify=j)  # type: ignore[arg-type]
    for i in range(len(picked[0][2]) if picked else 0):
        table.add_row(*(cells[i] for _, _, cells in picked))
    return table


def _print_table(results: Any, trace: dict[str, Any], seeds: int, plot: Path | None, paper_trace: bool = False) -> None:
    from kubegpu.cli.console import make_console
    from kubegpu.sim.replay import CHECKPOINTS
    from kubegpu.sim.study import PAPER_AT_100

    console = make_console()
    width = _target_width(console)
    console.print(
        f"Replayed [bold]{trace['pods']}[/] ({trace['pod_list']} pods, resampled to {trace['inflate']:.0%} of "
        f"GPU capacity) on [bold]{trace['nodes']}[/] ({trace['node_count']} nodes, {trace['gpus']} GPUs), "
        f"{seeds} seed(s) per policy" + (" (the paper's study uses --seeds 10)" if seeds < 10 else "") + "."
    )

    def cell(m: float | None, sd: float | None, sep: str) -> str:
        return "-" if m is None else (f"{m:.2f}" if seeds == 1 else f"{m:.2f}{sep}±{sep}{sd:.2f}")

    def columns(sep: str) -> list[tuple[str, str, list[str]]]:
        out = [("policy", "left", [n if s.gpu_policy == n else f"{n} / {s.gpu_policy}" for n, s in results.items()])]
        out += [(f"{p} %", "right", [cell(s.mean_at(p), s.sd_at(p), sep) for s in results.values()])
                for p in CHECKPOINTS]
        if paper_trace:  # the paper's published numbers are for its own trace only
            out.append(("paper @100", "right", ["-" if PAPER_AT_100.get(n) is None else f"{PAPER_AT_100[n]:.2f}"
                                                for n in results]))
        out.append(("frag @100", "right", ["-" if s.fragment_pct_at_100 is None else f"{s.fragment_pct_at_100:.2f}"
                                           for s in results.values()]))
        out.append(("s/run", "right", [f"{s.seconds:.1f}" for s in results.values()]))
        return out

    # Most telling first: the headline (100 %), the paper's value beside it, the ends of the range, then the rest.
    order = [100, 130, 80, 120, 110, 90, 95]
    keep = ["policy", "100 %", "paper @100", "130 %", "80 %", "frag @100", *(f"{p} %" for p in order[3:]), "s/run"]
    keep = [k for k in keep if k != "paper @100" or paper_trace]
    keep += [f"{p} %" for p in CHECKPOINTS if f"{p} %" not in keep]
    cols = columns(" ")
    if width is not None and len(_fit(cols, keep, width)) < len(cols):
        cols = columns("")  # "4.77±0.12" before dropping a column
    title = "Unallocated GPU % when the arrived GPU request reaches X % of capacity" + \
        (" (mean ± sd)" if seeds > 1 else "")
    console.print(_table(title, cols, keep, width))
    console.print(
        "frag @100: the FGD fragment of the free GPU (% of capacity) at arrived 100 %"
        + ("; paper @100: the FGD paper's published value." if paper_trace else ".")
    )
    console.print("Failed pods (mean per run over the whole replay, by kind):")
    for name, s in results.items():
        failed = ", ".join(f"{k} {v:g}" for k, v in sorted(s.failed.items(), key=lambda kv: -kv[1]))
        console.print(f"  {name}: {failed or 'none'}")
    if plot is not None:
        console.print(f"Figure written to {plot}")


def _run_timeline(
    node_list: Any, pod_list: Any, policies: list[str], gpu_policy: str | None, trace: dict[str, Any], as_json: bool
) -> None:
    from kubegpu.sim.timeline import replay_time

    bar = _progress_bar(as_json)
    results = {}
    for name in policies:
        if bar is not None:
            with bar:
                task = bar.add_task(f"{name} (time replay)", total=len(pod_list))

                def advance(done: int, total: int, _task: Any = task) -> None:
                    bar.update(_task, completed=done, total=total)

                results[name] = replay_time(node_list, pod_list, name, gpu_policy, advance,
                                             load=trace["load"])
        else:
            results[name] = replay_time(node_list, pod_list, name, gpu_policy, load=trace["load"])
    if as_json:
        print(json.dumps({"trace": trace, "policies": {n: r.to_json() for n, r in results.items()}}))
        return
    from kubegpu.cli.console import make_console

    console = make_console()
    console.print(
        f"Replayed [bold]{trace['pods']}[/] in time (creation and deletion timestamps, with departures) "
        f"on {trace['node_count']} nodes, {trace['gpus']} GPUs, arrivals compressed {trace['load']:g}x "
        f"(the load factor; pods keep their durations): peak concurrent GPU request "
        f"{next(iter(results.values())).peak_demand_pct:.1f} % of capacity."
    )
    rs = list(results.values())
    cols: list[tuple[str, str, list[str]]] = [
        ("policy", "right", list(results)),
        ("pods", "right", [str(r.pods) for r in rs]),
        ("failed GPU %", "right", [f"{r.failed_gpu_pct:.2f}" for r in rs]),
        ("failed pods", "left", [", ".join(f"{k} {v}" for k, v in sorted(r.failed.items(), key=lambda kv: -kv[1]))
                                 or "none" for r in rs]),
        ("mean alloc %", "right", [f"{r.mean_allocated_pct:.2f}" for r in rs]),
        ("peak alloc %", "right", [f"{r.peak_allocated_pct:.2f}" for r in rs]),
        ("free GPU % when dropping", "right", [f"{r.mean_unallocated_when_pending_pct:.2f}" for r in rs]),
        ("s", "right", [f"{r.seconds:.1f}" for r in rs]),
    ]
    keep = ["policy", "failed GPU %", "mean alloc %", "free GPU % when dropping", "peak alloc %", "pods",
            "failed pods", "s"]
    console.print(_table("Time replay", cols, keep, _target_width(console)))


def _run_reservations(
    node_list: Any, pod_list: Any, policies: list[str], gpu_policy: str | None, trace: dict[str, Any],
    config: Any, as_json: bool,
) -> None:
    from kubegpu.sim.queue import WIDTHS, replay_queue, trace_queue
    from kubegpu.sim.replay import target_workload

    queued = trace_queue(pod_list, trace["load"])
    workload = target_workload(pod_list)
    bar = _progress_bar(as_json)
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        for label, cfg in (("without", None), ("with", config)):
            def run(advance: Any = None, _cfg: Any = cfg, _name: str = name) -> Any:
                return replay_queue(node_list.cluster(), queued, _name, gpu_policy, _cfg, workload=workload,
                                    progress=advance)

            if bar is None:
                results.setdefault(name, {})[label] = run()
                continue
            with bar:
                task = bar.add_task(f"{name}, {label} reservations", total=len(queued))

                def advance(done: int, total: int, _task: Any = task) -> None:
                    bar.update(_task, completed=done, total=total)

                results.setdefault(name, {})[label] = run(advance)
    if as_json:
        print(json.dumps({"trace": trace, "policies": {
            n: {k: r.to_json() for k, r in by.items()} for n, by in results.items()}}))
        return
    from kubegpu.cli.console import make_console

    console = make_console()
    console.print(
        f"Replayed [bold]{trace['pods']}[/] in time with a waiting queue on {trace['node_count']} nodes, "
        f"{trace['gpus']} GPUs, arrivals compressed {trace['load']:g}x; reservations for pods of "
        f"{config.min_gpus}+ whole GPUs after {config.wait_seconds:g} s, at most {config.max_share:.0%} of the GPUs."
    )
    rows = [(n, label, r) for n, by in results.items() for label, r in by.items()]

    def width_cell(r: Any, w: str) -> str:
        s = r.stats((w,))
        if not s.pods:
            return "-"
        never = f", {s.never_placed} never" if s.never_placed else ""
        return f"{s.wait_p50_s:.0f} / {s.wait_p99_s:.0f}{never}"

    cols: list[tuple[str, str, list[str]]] = [
        ("policy", "right", [n for n, _, _ in rows]),
        ("reservations", "left", [label for _, label, _ in rows]),
        *((f"{w} wait p50/p99 s", "right", [width_cell(r, w) for _, _, r in rows]) for w in WIDTHS),
        ("held idle GPU-h", "right", [f"{r.held_idle_gpu_s / 3600:.2f}" for _, _, r in rows]),
        ("idle cost %", "right", [f"{r.idle_gpu_cost_pct:.2f}" for _, _, r in rows]),
        ("s", "right", [f"{r.seconds:.1f}" for _, _, r in rows]),
    ]
    keep = ["policy", "reservations", *(f"{w} wait p50/p99 s" for w in reversed(WIDTHS)), "idle cost %",
            "held idle GPU-h", "s"]
    console.print(_table("Waits by pod width (never: still waiting at the end)", cols, keep,
                         _target_width(console)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
