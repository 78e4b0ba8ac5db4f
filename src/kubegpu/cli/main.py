"""The ``kubegpu`` command. Each role registers its command here; imports stay lazy so
``kubegpu --help`` and the light commands start fast."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kubegpu",
    help="GPU scheduling for Kubernetes: device plugins, fine-grained sharing, admission, "
    "placement and a trace simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: it wraps descriptions under each option at any width, where rich's boxed
    # tables cut option names (`--exclude-names…`) at 80 columns and label flags `<bool>`.
    rich_markup_mode=None,
)


def version_string() -> str:
    """``kubegpu <version> (commit <hash>, <date>...)``: which build runs (:mod:`kubegpu.cli.buildinfo`)."""
    from kubegpu.cli.buildinfo import build_info

    return str(build_info())


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_string())
        raise typer.Exit(0)


@app.callback()
def _root(
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="Print the version, commit and date of this build, and exit."),
) -> None:
    """kubegpu: run a role (node, scheduler, webhook), check manifests, simulate, or show status."""


def kubectl_gpu() -> None:
    """Entry point of the ``kubectl-gpu`` plugin: ``kubectl gpu`` is ``kubegpu status``."""
    import sys

    sys.argv = ["kubegpu", "status", *sys.argv[1:]]
    app()


def _register() -> None:
    # Each command module adds itself to `app` on import.
    import importlib

    for module in ("check", "simulate", "node", "scheduler", "webhook", "status", "manifests", "demo"):
        try:
            importlib.import_module(f"kubegpu.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kubegpu.cli.{module}":
                raise


_register()
