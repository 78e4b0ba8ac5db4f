"""The node configuration's command-line flags: argparse arguments made from the option table.

``kubegpu node`` reads its command line with the standard library's argparse, so the daemon starts without
a CLI framework, and every configuration flag is made here from :data:`~kubegpu.node.config.OPTIONS`: the
parser, the loader and ``--help`` read one table and cannot disagree. Only the flags given reach the loader,
each under the name it was given (``--driver-root`` or ``--nvidia-driver-root``; giving both is the loader's
error), so the environment and the file fill in the rest (flag > environment > file > default).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Final

from kubegpu.node.config.options import CONFIG_FILE_ENV, CONFIG_FILE_FLAG, OPTIONS, Option
from kubegpu.node.config.refused import REFUSED
from kubegpu.node.config.select import CONFIG_DIR_ENV, CONFIG_DIR_FLAG

# The namespace attribute the given flags are collected in: flag name (without dashes) -> value as given.
GIVEN: Final = "config_flags"


class _Given(argparse.Action):
    """Keeps a configuration flag under the name given; a boolean flag alone means true, as NVIDIA's flags."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        given = dict(getattr(namespace, GIVEN, None) or {})
        given[(option_string or self.dest).lstrip("-")] = "true" if values is None else values
        setattr(namespace, GIVEN, given)


def shown_default(o: Option) -> str:
    """An option's default as ``--help`` shows it (a value the flag takes back, or none)."""
    d = o.default
    if isinstance(d, tuple):
        return ",".join(map(str, d)) or "none"
    if o.kind == "duration":
        return f"{d:g}s"
    return str(d) if d != "" else "none"


def _help(o: Option) -> str:
    if o.key in REFUSED:
        text = f"{o.help}; accepted only at NVIDIA's default, kubegpu cannot honour other values"
    elif o.kind == "bool":
        text = f"{o.help}; {'on by default (=false turns it off)' if o.default else 'off unless given'}"
    else:
        choices = f" ({', '.join(o.choices)})" if o.choices and o.kind in ("choice", "choices") else ""
        text = f"{o.help}{choices}; default {shown_default(o)}"
    return f"{text} [env {', '.join(o.envs)}]".replace("%", "%%")  # argparse formats help with %


def _section(o: Option) -> str:
    if o.key.startswith("kubegpu.dra."):
        return "DRA driver options (with --kubelet-plugin dra)"
    if o.key.startswith("kubegpu."):
        return "kubegpu options"
    return "NVIDIA device-plugin options"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every configuration flag (each option, its aliases, the config file and directory) to ``parser``,
    grouped as ``--help`` shows them; what was given ends up in ``namespace.config_flags``."""
    parser.set_defaults(**{GIVEN: None})
    groups: dict[str, Any] = {}

    def group(title: str) -> Any:
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    nvidia = group("NVIDIA device-plugin options")
    nvidia.add_argument(f"--{CONFIG_FILE_FLAG}", action=_Given, metavar="FILE", default=argparse.SUPPRESS,
                        help=f"the config file (NVIDIA's format plus a kubegpu: section) [env {CONFIG_FILE_ENV}]")
    nvidia.add_argument(f"--{CONFIG_DIR_FLAG}", action=_Given, metavar="DIR", default=argparse.SUPPRESS,
                        help="the mounted config.map entries; the node's nvidia.com/device-plugin.config label "
                             f"picks one, else the config file above is used [env {CONFIG_DIR_ENV}]")
    for o in OPTIONS:
        names = [f"--{n}" for n in (o.flag, *o.aliases)]
        if o.kind == "bool":
            group(_section(o)).add_argument(*names, action=_Given, nargs="?", metavar="BOOL",
                                            default=argparse.SUPPRESS, help=_help(o))
        else:
            group(_section(o)).add_argument(*names, action=_Given, metavar="VALUE", default=argparse.SUPPRESS,
                                            help=_help(o))
