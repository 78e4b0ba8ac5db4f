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
)


@app.callback()
def _root() -> None:
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
