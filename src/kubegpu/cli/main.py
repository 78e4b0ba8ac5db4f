"""The ``kubegpu`` command. Each role registers its command here; imports stay lazy so
``kubegpu --help`` and the light commands start fast.

:func:`main` is the console script. A process started as ``kubegpu node ...`` (the node daemon, on every
GPU node for its whole life) goes straight to :func:`kubegpu.cli.node_entry.main`, which reads its command
line with argparse, so it never loads typer, rich or the other commands (its memory budget is close to
NVIDIA's plugin's). Every other command is the typer app, :data:`app`, built on first use.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

HELP = ("GPU scheduling for Kubernetes: device plugins, fine-grained sharing, admission, "
        "placement and a trace simulator.")


def version_string() -> str:
    """``kubegpu <version> (commit <hash>, <date>...)``: which build runs (:mod:`kubegpu.cli.buildinfo`)."""
    from kubegpu.cli.buildinfo import build_info

    return str(build_info())


def _print_version(value: bool) -> None:
    import typer

    if value:
        typer.echo(version_string())
        raise typer.Exit(0)


def _build() -> typer.Typer:
    import typer

    full = typer.Typer(
        name="kubegpu",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        # Plain click help: it wraps descriptions under each option at any width, where rich's boxed
        # tables cut option names (`--exclude-names…`) at 80 columns and label flags `<bool>`.
        rich_markup_mode=None,
    )

    @full.callback()
    def _root(
        _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print the version, commit and date of this build, and exit."),
    ) -> None:
        """kubegpu: run a role (node, scheduler, webhook), check manifests, simulate, or show status."""

    return full


_full: typer.Typer | None = None
app: typer.Typer  # set by full_app(); until then the module's __getattr__ builds it


def full_app() -> typer.Typer:
    """The typer app with every command registered (built on first use)."""
    global _full, app
    if _full is None:
        _full = _build()
        app = _full  # each command module adds itself to `kubegpu.cli.main.app` as it is imported
        _register()
    return _full


def _register() -> None:
    import importlib

    for module in ("check", "simulate", "node", "scheduler", "webhook", "status", "manifests", "demo"):
        try:
            importlib.import_module(f"kubegpu.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kubegpu.cli.{module}":
                raise


def main() -> None:
    """The ``kubegpu`` console script."""
    if sys.argv[1:2] == ["node"]:
        from kubegpu.cli.node_entry import main as node_main

        sys.exit(node_main())
    full_app()()


def kubectl_gpu() -> None:
    """Entry point of the ``kubectl-gpu`` plugin: ``kubectl gpu`` is ``kubegpu status``."""
    sys.argv = ["kubegpu", "status", *sys.argv[1:]]
    full_app()()


def __getattr__(name: str) -> Any:
    # `app` is built when first asked for (a command module registering itself, a test), never on import:
    # the node process imports this module and must not load typer.
    if name == "app":
        return full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
