"""Which GPUs MPS can enforce shares on, and how each GPU's shares are enforced: pure, one rule each.

An operator sees this per GPU (``kubegpu status``, the Device object, DRA slice attributes, metrics), so
a GPU is never silently unenforced: it is ``mps`` (its daemon answers), ``none`` (enforcement not
selected: shares are labels), or ``unenforced`` with the reason (MIG, pre-Volta, time-slicing, daemon down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kubegpu.model.inventory import Gpu

MODE_MPS: Final = "mps"
MODE_NONE: Final = "none"
MODE_UNENFORCED: Final = "unenforced"
ENFORCEMENT_MODES: Final = (MODE_NONE, MODE_MPS)
VOLTA: Final = (7, 0)  # MPS limits threads and pinned memory per client from Volta on


@dataclass(frozen=True, slots=True)
class Enforcement:
    """How the shares on one GPU are enforced."""

    mode: str  # mps, none, unenforced
    reason: str = ""

    @property
    def enforced(self) -> bool:
        return self.mode == MODE_MPS


def refusal(gpu: Gpu, time_sliced: bool = False) -> str:
    """Why MPS cannot enforce shares on ``gpu`` ("" when it can)."""
    if gpu.mig_enabled:
        return "MIG is enabled: MIG devices are isolated by the hardware and cannot be shared with MPS"
    cc = gpu.compute_capability
    if cc is not None and tuple(cc) < VOLTA:
        return (f"compute capability {cc[0]}.{cc[1]} is older than Volta (7.0): MPS cannot limit a client's "
                "threads or memory there")
    if time_sliced:
        return "the GPU is served as time-slicing replicas: MPS limits and time-slicing cannot be mixed"
    return ""


def gpu_enforcement(gpu: Gpu, selected: str, *, time_sliced: bool = False, daemon_down: str = "",
                    binary_missing: str = "") -> Enforcement:
    """The one rule: ``selected`` is the operator's setting (``none`` or ``mps``)."""
    if selected != MODE_MPS:
        return Enforcement(MODE_NONE, "share enforcement is off (shareEnforcement: none)")
    why = refusal(gpu, time_sliced) or binary_missing or daemon_down
    return Enforcement(MODE_UNENFORCED, why) if why else Enforcement(MODE_MPS)
