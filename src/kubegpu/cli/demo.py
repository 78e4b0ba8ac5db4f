"""``kubegpu demo``: run the whole system on this machine (no cluster, no GPU) and check its end state.

The story and the checks live in :mod:`kubegpu.demo`; this module is the command line: options,
where the output goes (``--json`` keeps stdout for the one summary object), Ctrl-C / SIGTERM
turned into an orderly stop, and the exit code (0 every check passed, 1 a check failed,
2 the cluster could not start, 130 interrupted).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import typer

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app

EXIT_OK, EXIT_FAILED, EXIT_START, EXIT_INTERRUPTED = 0, 1, 2, 130


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@app.command("demo", short_help="Run the whole system on this machine; ends by itself.")
def demo(
    short: bool = typer.Option(False, "--short", help="No pauses between steps (what CI runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object as the last line "
                                 "of stdout (the story goes to stderr)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Show only the verdict."),
    keep_running: float = typer.Option(0.0, "--keep-running", min=0.0, max=86400.0, metavar="SECONDS",
                                       help="Keep the cluster up this long after the checks (try kubegpu status "
                                            "against it); default: end at once."),
    workdir: Path | None = typer.Option(None, "--workdir", metavar="DIR", file_okay=False,
                                        help="Keep sockets, logs and the kubeconfig here instead of a "
                                             "temporary directory that is removed at the end."),
    debug: bool = typer.Option(False, "--debug", help="Log the demo's own steps and show tracebacks."),
    settle_timeout: float = typer.Option(30.0, "--settle-timeout", min=1.0, max=600.0, metavar="SECONDS",
                                         help="How long to wait for a wave of pods to run."),
    dra: bool = typer.Option(False, "--dra", help="Run the DRA path instead (ResourceSlices, claims, "
                             "NodePrepareResources; see kubegpu.demo.dra)."),
) -> None:
    """Run the stand-in API server and kubelets, three fake GPU nodes (kubegpu node), the extender and
    the webhook on this machine; submit pods in every request style, inject an Xid, show the live view
    and each container's environment, then verify the end state. Ends by itself.
    """
    # gRPC core logs every GOAWAY it sees at shutdown on stderr; the story has no use for them.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        from kubegpu.demo.cluster import ClusterError
        from kubegpu.demo.scenario import DemoOptions, run_demo
    except ImportError as exc:  # the runtime image carries neither the demo nor the stand-ins
        typer.echo(f"error: kubegpu demo is not installed here ({exc}): pip install 'kubegpu[demo]'", err=True)
        raise typer.Exit(2) from None

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if debug:
        logging.getLogger("kubegpu").setLevel(logging.DEBUG)
    console = make_console(stderr=as_json, highlight=False)
    opts = DemoOptions(short=short, quiet=quiet, keep_running_s=keep_running, workdir=workdir,
                       settle_timeout_s=settle_timeout)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if dra:  # the DRA path (docs/dra.md)
        from kubegpu.demo.dra import run_dra_demo

        try:
            dra_result = run_dra_demo(console, workdir=workdir, quiet=quiet)
        except Exception as exc:
            console.print(f"[red]the DRA demo failed:[/] {type(exc).__name__}: {exc}")
            if as_json:
                print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
            raise typer.Exit(EXIT_FAILED) from None
        finally:
            signal.signal(signal.SIGTERM, previous)
        if as_json:
            print(json.dumps(dra_result.summary, separators=(",", ":")))
        raise typer.Exit(EXIT_OK if dra_result.ok else EXIT_FAILED)
    try:
        result = run_demo(opts, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every role stopped[/]" + (f", files kept in {workdir}" if workdir
                                                                      else ", files removed"))
        if as_json:
            print(json.dumps({"ok": False, "interrupted": True}))
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except ClusterError as exc:
        console.print(f"[red]the local cluster did not start:[/] {exc}")
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        raise typer.Exit(EXIT_START) from None
    except Exception as exc:  # every role is stopped by now; say what broke, keep the traceback for --debug
        logging.getLogger("kubegpu.demo").debug("demo failed", exc_info=True)
        console.print(f"[red]the demo failed:[/] {type(exc).__name__}: {exc}")
        if as_json:
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        raise typer.Exit(EXIT_FAILED) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    passed = sum(c.ok for c in result.checks)
    verdict = (f"[green]demo passed[/]: {passed}/{len(result.checks)} checks" if result.ok
               else f"[red]demo failed[/]: {len(result.checks) - passed} of {len(result.checks)} checks failed")
    console.print(verdict + f" in {result.summary['timings']['total_s']:.1f} s")
    if as_json:
        sys.stdout.write(json.dumps(result.summary, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    raise typer.Exit(EXIT_OK if result.ok else EXIT_FAILED)
