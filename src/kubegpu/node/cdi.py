"""The CDI spec for this node's GPUs, and the fully qualified names Allocate hands out.

With the ``cdi-annotations`` / ``cdi-cri`` device-list strategies the container runtime
injects devices from a CDI spec file instead of reading ``NVIDIA_VISIBLE_DEVICES``
(contracts.md §4). The spec names every GPU and MIG device twice, by UUID and by index, so
both device-ID strategies resolve; it is rewritten atomically (temp file + rename) so a
runtime never reads half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.devspecs import CONTROL_DEVICES, mig_cap_paths

CDI_VERSION = "0.5.0"  # no spec-level annotations, no intelRdt / netDevices: 0.5.0 is enough
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_KIND_PART_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


class CdiError(ValueError):
    """A name or kind that the CDI rules refuse."""


def qualified_name(vendor: str, cls: str, name: str) -> str:
    """``vendor/class=name`` after checking each part against the CDI rules."""
    if not _KIND_PART_RE.match(vendor) or not _KIND_PART_RE.match(cls):
        raise CdiError(f"invalid CDI kind {vendor}/{cls}")
    if not _NAME_RE.match(name):
        raise CdiError(f"invalid CDI device name {name!r}")
    return f"{vendor}/{cls}={name}"


def annotation_key(prefix: str, plugin: str, device_id: str) -> str:
    """``cdi.k8s.io/<plugin>_<id>`` with ``/`` in the id replaced, as the CDI annotation rules want."""
    part = f"{plugin}_{device_id.replace('/', '_')}"
    if len(part) > 63:
        raise CdiError(f"CDI annotation key part too long ({len(part)} > 63): {part}")
    return prefix + part


def _node(path: str, driver_root: str) -> dict[str, Any]:
    host = os.path.join(driver_root, path.lstrip("/")) if driver_root not in ("", "/") else path
    out: dict[str, Any] = {"path": path}
    if host != path:
        out["hostPath"] = host
    return out


def build_spec(inventory: NodeInventory, *, vendor: str, cls: str, driver_root: str = "/",
               mig_minors: dict[tuple[int, int, int], int] | None = None) -> dict[str, Any]:
    """The CDI spec (as a JSON-ready dict) for every GPU and MIG device of ``inventory``."""
    devices: list[dict[str, Any]] = []
    for g in inventory.gpus:
        edits = {"deviceNodes": [_node(f"/dev/nvidia{g.minor}", driver_root)]}
        for name in (g.uuid, str(g.index)):
            devices.append({"name": name, "containerEdits": edits})
        for m in g.mig_devices:
            nodes = [_node(f"/dev/nvidia{g.minor}", driver_root)]
            nodes += [_node(p, driver_root) for p in mig_cap_paths(g.minor, m.gi, m.ci, mig_minors or {})]
            for name in (m.uuid, f"{g.index}:{m.index}"):
                devices.append({"name": name, "containerEdits": {"deviceNodes": nodes}})
    for d in devices:
        qualified_name(vendor, cls, d["name"])  # validate every name before writing
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{vendor}/{cls}",
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [_node(p, driver_root) for p in CONTROL_DEVICES],
        },
    }


def spec_path(cdi_dir: str | os.PathLike[str], vendor: str, cls: str) -> Path:
    return Path(cdi_dir) / f"{vendor}-{cls}.json"


def write_spec(spec: dict[str, Any], cdi_dir: str | os.PathLike[str], vendor: str, cls: str) -> Path:
    """Write ``spec`` to ``<cdi_dir>/<vendor>-<class>.json`` atomically; returns the path."""
    target = spec_path(cdi_dir, vendor, cls)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kubegpu-cdi-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def qualified_names(vendor: str, cls: str, names: Sequence[str] | Iterable[str]) -> list[str]:
    return [qualified_name(vendor, cls, n) for n in names]
