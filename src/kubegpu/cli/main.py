"""The ``kubegpu`` command. Each role registers its command here; imports stay lazy so
``kubegpu --help`` and the light commands start fast.

A process started as ``kubegpu node ...`` (the node daemon, on every GPU node for its whole life)
does not load typer, rich or the other commands at all: ``app`` is then a small entry that runs the
node through :func:`kubegpu.cli.node_entry.lean_main` and builds the full CLI only for what that
does not take (``--help``, a malformed option), so every input behaves as before (about 12 MB less
resident memory; the node's budget is 60 MB).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

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


def _started_as_node() -> bool:
    return sys.argv[1:2] == ["node"]


class _NodeEntry:
    """``app`` in a process started as ``kubegpu node``: the console script calls it with no arguments."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and _started_as_node():
            from kubegpu.cli.node_entry import lean_main

            code = lean_main(sys.argv[2:])
            if code is not None:
                sys.exit(code)
        return full_app()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # A command module imported some other way still registers on (and reads) the full app.
        return getattr(full_app(), name)


def kubectl_gpu() -> None:
    """Entry point of the ``kubectl-gpu`` plugin: ``kubectl gpu`` is ``kubegpu status``."""
    sys.argv = ["kubegpu", "status", *sys.argv[1:]]
    full_app()()


app: typer.Typer
if _started_as_node():
    # Called by the console script (`app()`); any other use of it is the full app's (see __getattr__).
    app = cast("typer.Typer", _NodeEntry())
else:
    full_app()
