"""What a container gets from its CDI devices: the container runtime's CDI injection and the NVIDIA
container toolkit's device list, as the real components do them (test stand-in, never product runtime).

The kubelet hands the runtime the CDI device IDs of every claim a container uses, in the order of
the container's ``resources.claims`` (recorded: ``kubelet-runtime-cdi-devices.jsonl``). The runtime
(containerd / CRI-O through the ``container-device-interface`` library) resolves each ID to its spec
and applies, in that order, each spec's ``containerEdits`` once (at the first of its devices) and
then the device's own edits:

- ``env``: set in order, so a later value of the same variable replaces an earlier one (the
  library adds each entry with the OCI generator's "add process env", which overwrites);
- ``deviceNodes``: added, one per path;
- ``mounts``: added, one per container path (a later one replaces an earlier one at the same path).

An unknown ID fails the container start (``unresolvable CDI devices``), as the library does.

The NVIDIA container toolkit then takes the container's GPU list either from
``NVIDIA_VISIBLE_DEVICES`` (its default) or, with ``accept-nvidia-visible-devices-as-volume-mounts``
(NVIDIA's recommended setting where unprivileged pods must not pick GPUs by env), from the mounts
under ``/var/run/nvidia-container-devices``: :func:`toolkit_devices`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"


class CdiError(RuntimeError):
    """The runtime cannot start the container: a CDI device it cannot resolve."""


@dataclass
class ContainerConfig:
    env: dict[str, str] = field(default_factory=dict)
    device_nodes: list[str] = field(default_factory=list)
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> host path


def _registry(cdi_dir: Path) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """Qualified device name -> (spec file, spec, device)."""
    out: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for f in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(f.read_text())
        for d in spec.get("devices") or []:
            out[f"{spec['kind']}={d['name']}"] = (f.name, spec, d)
    return out


def _apply(cfg: ContainerConfig, edits: dict[str, Any]) -> None:
    for e in edits.get("env") or []:
        k, _, v = e.partition("=")
        cfg.env.pop(k, None)
        cfg.env[k] = v
    for n in edits.get("deviceNodes") or []:
        if n["path"] not in cfg.device_nodes:
            cfg.device_nodes.append(n["path"])
    for m in edits.get("mounts") or []:
        cfg.mounts[m["containerPath"]] = m["hostPath"]


def inject(cdi_dir: str | Path, device_ids: list[str]) -> ContainerConfig:
    """The container's env, device nodes and mounts from ``device_ids``, in the runtime's order."""
    reg = _registry(Path(cdi_dir))
    missing = [i for i in device_ids if i not in reg]
    if missing:
        raise CdiError(f"unresolvable CDI devices {', '.join(missing)}")
    cfg = ContainerConfig()
    seen: set[str] = set()
    for i in device_ids:
        fname, spec, dev = reg[i]
        if fname not in seen:
            seen.add(fname)
            _apply(cfg, spec.get("containerEdits") or {})
        _apply(cfg, dev.get("containerEdits") or {})
    return cfg


def toolkit_devices(cfg: ContainerConfig, *, volume_mounts: bool) -> list[str]:
    """The GPUs (UUIDs) the NVIDIA container toolkit sets the container up with."""
    if volume_mounts:
        return [p.rsplit("/", 1)[1] for p in cfg.mounts if p.startswith(VOLUME_MOUNTS_ROOT + "/")]
    value = cfg.env.get("NVIDIA_VISIBLE_DEVICES", "")
    return [] if value in ("", "void", "none") else value.split(",")
