"""``-o json|yaml|wide``, as kubectl spells it, for every command that prints a report.

One place decides which formats exist and how data is printed in them, so ``check`` and ``status`` (and
whatever adds ``-o`` next) accept the same words and print JSON and YAML the same way.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
import yaml

FORMATS = ("json", "yaml", "wide")


def output_format(value: str, allowed: tuple[str, ...] = FORMATS) -> str:
    """The format asked for ('' is the default table); anything else is a usage error (exit 2), as kubectl's
    ``error: unable to match a printer suitable for the output format``."""
    fmt = value.strip().lower()
    if fmt and fmt not in allowed:
        raise typer.BadParameter(f"{value!r}: use one of {', '.join(allowed)}", param_hint="'-o' / '--output'")
    return fmt


def print_data(data: Any, fmt: str) -> None:
    """Print a report as one JSON document (one line, so tools can read the last line) or as YAML."""
    if fmt == "yaml":
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1 << 16))
    else:
        sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()
