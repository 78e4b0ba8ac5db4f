"""``kubegpu node`` in the typer app: it lists the command in ``kubegpu --help`` and hands every argument,
``--help`` included, to the node's own parser (:mod:`kubegpu.cli.node_entry`), which alone declares the
command's options, so there is one command line to keep.
"""

from __future__ import annotations

import typer

from kubegpu.cli.main import app
from kubegpu.cli.node_entry import main


@app.command(
    "node",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def node_command(ctx: typer.Context) -> None:
    """Serve this node's GPUs to the kubelet (device plugins or DRA), watch their health, export metrics.

    Takes NVIDIA's device-plugin flags, environment variables and config file unchanged; `kubegpu node --help`
    lists every option."""
    raise typer.Exit(main(list(ctx.args)))
