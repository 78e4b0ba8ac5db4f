"""The share shape a GPU's MPS server enforces: one rule for the node, the placement core and the extender.

Under strict enforcement a GPU runs one MPS server whose defaults bind every share on it, so it serves one share
shape at a time (docs/sharing.md). Whether two shares have the same shape is decided on what the node
enforces on that GPU, not on how the pod asked: the active-thread percent and the pinned-memory limit in MiB of
the granted part (a memory ratio has already resolved to bytes of that GPU's memory in the grant; a memory-only
share gets every thread, a share without memory all of the GPU's memory), and how many GPUs the share spans
(one server over all of them). The node keys its daemons by it (node/mps), the simulator and the extender
lock GPUs by it (placement/shape_lock.py, scheduler/shape_locks.py).

The memory functions are plain arithmetic without branches, so they apply elementwise to numpy arrays as
well: the placement core's (N, G) masks use this very rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, overload

if TYPE_CHECKING:
    import numpy as np

MIB: Final = 2**20
_SHAPE_RE: Final = re.compile(r"^(\d+)% / (\d+)M(?: over (\d+) GPUs)?$")


def enforced_percent(core_percent: int) -> int:
    """The active-thread percent a share part gets: a part recorded with no compute (memory only) or with all
    of it runs with every thread."""
    return core_percent if 1 <= core_percent <= 100 else 100


@overload
def enforced_memory(memory_bytes: int, gpu_memory_bytes: int) -> int: ...
@overload
def enforced_memory(memory_bytes: np.ndarray, gpu_memory_bytes: np.ndarray) -> np.ndarray: ...
def enforced_memory(memory_bytes: int | np.ndarray, gpu_memory_bytes: int | np.ndarray) -> int | np.ndarray:
    """The pinned-memory bytes a share part gets: a part without memory has all of the GPU's."""
    return memory_bytes + (memory_bytes == 0) * gpu_memory_bytes


@overload
def memory_mib(memory_bytes: int) -> int: ...
@overload
def memory_mib(memory_bytes: np.ndarray) -> np.ndarray: ...
def memory_mib(memory_bytes: int | np.ndarray) -> int | np.ndarray:
    """The MPS memory limit of ``memory_bytes``, in whole MiB and at least 1 (the daemon takes MiB)."""
    return memory_bytes // MIB + (memory_bytes < MIB)


@dataclass(frozen=True, slots=True)
class ShareShape:
    """What one GPU's MPS server enforces for each share on it."""

    percent: int  # active-thread percent, 1..100
    memory_mib: int  # pinned device memory limit
    spans: int = 1  # GPUs the share spans: one server over all of them

    def describe(self) -> str:
        """As the node reports a GPU's lock (Device object, DRA slice attribute, metrics); :func:`parse_shape`
        reads it back."""
        over = f" over {self.spans} GPUs" if self.spans > 1 else ""
        return f"{self.percent}% / {self.memory_mib}M{over}"

    def human(self) -> str:
        """For reasons a user reads (no ``%``: kube-scheduler's Event formats the reason)."""
        mem = f"{self.memory_mib // 1024}Gi" if self.memory_mib % 1024 == 0 else f"{self.memory_mib}Mi"
        over = f" over {self.spans} GPUs" if self.spans > 1 else ""
        return f"{self.percent} percent / {mem}{over}"


def share_shape(core_percent: int, memory_bytes: int, gpu_memory_bytes: int, spans: int = 1) -> ShareShape:
    """The shape a granted share part is enforced with on its GPU (``memory_bytes`` 0: all of it)."""
    return ShareShape(enforced_percent(core_percent),
                      memory_mib(enforced_memory(memory_bytes, gpu_memory_bytes)), spans)


def is_whole_part(core_percent: int, memory_bytes: int, gpu_memory_bytes: int) -> bool:
    """Whether a granted part is the whole GPU (nothing to share, nothing to enforce)."""
    return (enforced_percent(core_percent) >= 100
            and enforced_memory(memory_bytes, gpu_memory_bytes) >= gpu_memory_bytes)


def parse_shape(text: str) -> ShareShape | None:
    """A lock as :meth:`ShareShape.describe` writes it; None for '' or a text it did not write."""
    m = _SHAPE_RE.match(text.strip())
    if m is None:
        return None
    return ShareShape(int(m.group(1)), int(m.group(2)), int(m.group(3) or 1))
