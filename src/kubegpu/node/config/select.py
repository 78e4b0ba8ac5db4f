"""Per-node configuration: NVIDIA's ``nvidia.com/device-plugin.config`` node label picks a ``config.map`` entry.

NVIDIA's chart mounts every entry of ``config.map`` and its config-manager sidecar reads the node's label:
the label names the entry this node uses; without it the chart's default entry (``config.default``, or by
``config.fallbackStrategies``) is used. kubegpu does the same inside the node daemon: ``CONFIG_DIR`` is the
mounted directory, ``CONFIG_FILE`` the default entry, and the label is read from the node's own Node
object at start and whenever it changes (the daemon reloads).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from kubegpu.node.config.model import ConfigError

CONFIG_LABEL: Final = "nvidia.com/device-plugin.config"
CONFIG_DIR_ENV: Final = "CONFIG_DIR"
CONFIG_DIR_FLAG: Final = "config-dir"


def config_dir(flags: Mapping[str, Any], env: Mapping[str, str]) -> str:
    return str(flags.get(CONFIG_DIR_FLAG) or env.get(CONFIG_DIR_ENV) or "")


def select_config_file(directory: str, label: str | None) -> str | None:
    """The entry the node label names (a path), or None when the node has no label (use the default).

    A label naming an entry that is not mounted is an error, as in NVIDIA's config-manager."""
    if not label:
        return None
    if not directory:
        raise ConfigError(f"node label {CONFIG_LABEL}={label!r}: no config directory (CONFIG_DIR) is mounted; "
                          "set config.map in the values")
    root = Path(directory)
    entries = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith(".")) \
        if root.is_dir() else []
    if label not in entries or "/" in label:
        raise ConfigError(f"node label {CONFIG_LABEL}={label!r}: config.map has no such entry "
                          f"(entries: {', '.join(entries) or 'none'})")
    return str(root / label)


def with_node_config(flags: Mapping[str, Any], env: Mapping[str, str], label: str | None) -> dict[str, Any]:
    """``flags`` with ``config-file`` set to the entry the node label selects (unchanged without a label)."""
    chosen = select_config_file(config_dir(flags, env), label)
    out = {k: v for k, v in flags.items() if k != CONFIG_DIR_FLAG}
    if chosen is not None:
        out["config-file"] = chosen
    return out
