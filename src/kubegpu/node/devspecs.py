"""The ``/dev`` nodes a container needs for its GPUs (``passDeviceSpecs`` and the CDI spec).

A GPU is ``/dev/nvidia<minor>`` plus the control nodes; a MIG device also needs its GI and
CI capability nodes, whose minors the driver lists in ``/proc/driver/nvidia-caps/mig-minors``
(lines ``gpu<minor>/gi<gi>/access <capMinor>`` and ``gpu<minor>/gi<gi>/ci<ci>/access <capMinor>``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

CONTROL_DEVICES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_LINE_RE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")

# (gpu minor, gi, ci) -> cap minor; ci = -1 for the GPU-instance access node.
MigMinors = dict[tuple[int, int, int], int]


def read_mig_minors(path: str | Path) -> MigMinors:
    """Parse the driver's mig-minors file; a missing or unreadable file gives an empty map."""
    out: MigMinors = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        log.debug("no MIG capability minors at %s: %s", path, exc)
        return out
    for line in text.splitlines():
        m = _LINE_RE.match(line.strip())
        if not m:
            continue
        gpu, gi, ci, cap = m.groups()
        out[(int(gpu), int(gi), int(ci) if ci is not None else -1)] = int(cap)
    return out


def mig_cap_paths(gpu_minor: int, gi: int, ci: int, minors: MigMinors) -> list[str]:
    """The nvidia-caps nodes of one MIG device (empty when the driver did not list them)."""
    out = []
    for key in ((gpu_minor, gi, -1), (gpu_minor, gi, ci)):
        cap = minors.get(key)
        if cap is not None:
            out.append(f"/dev/nvidia-caps/nvidia-cap{cap}")
    return out
