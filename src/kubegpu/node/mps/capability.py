"""Which GPUs MPS can enforce shares on, and how each GPU's shares are enforced: pure, one rule each.

An operator sees this per GPU (``kubegpu status``, the Device object, DRA slice attributes, metrics), so
a GPU is never silently unenforced: it is ``strict`` or ``mps`` (its daemon answers), ``none`` (enforcement
not selected: shares are labels), or ``unenforced`` with the reason (MIG, pre-Volta, time-slicing, daemon
down). The operator's setting names what each guarantees (docs/sharing.md, "Enforcement modes"):

- ``strict``: one MPS server per GPU, the GPU in ``EXCLUSIVE_PROCESS`` while it holds shares, one share shape
  per GPU at a time: no edit a container can make (environment, pipe directory) takes more than its share;
- ``mps`` (also spelt ``per-shape``): one server per share shape, the GPU left in its own mode: a container
  that goes through its server is held to its share, one that empties or unsets its pipe directory escapes;
- ``none``: the limits are environment variables only, which the container can change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kubegpu.model.inventory import Gpu
from kubegpu.model.share_enforcement import STRICT, UNENFORCED

MODE_MPS: Final = "mps"
MODE_STRICT: Final = STRICT
MODE_NONE: Final = "none"
MODE_UNENFORCED: Final = UNENFORCED
PER_SHAPE: Final = "per-shape"  # the operator's other name for MODE_MPS
ENFORCEMENT_MODES: Final = (MODE_NONE, MODE_MPS, MODE_STRICT)
ENFORCED_MODES: Final = (MODE_MPS, MODE_STRICT)  # modes that run MPS daemons for fine-grained shares
VOLTA: Final = (7, 0)  # MPS limits threads and pinned memory per client from Volta on


@dataclass(frozen=True, slots=True)
class Enforcement:
    """How the shares on one GPU are enforced."""

    mode: str  # strict, mps, none, unenforced
    reason: str = ""

    @property
    def enforced(self) -> bool:
        return self.mode in ENFORCED_MODES

    @property
    def escapable(self) -> bool:
        """Whether a container on this GPU could take more than its share by editing what it was given."""
        return self.mode != MODE_STRICT


def selected_mode(setting: str) -> str:
    """The operator's setting as one of :data:`ENFORCEMENT_MODES` (``per-shape`` is ``mps``)."""
    mode = MODE_MPS if setting == PER_SHAPE else setting
    if mode not in ENFORCEMENT_MODES:
        raise ValueError(f"share enforcement {setting!r} is not one of {', '.join(ENFORCEMENT_MODES)}, {PER_SHAPE}")
    return mode


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
    """The one rule: ``selected`` is the operator's setting (``none``, ``mps`` or ``strict``)."""
    if selected not in ENFORCED_MODES:
        return Enforcement(MODE_NONE, "share enforcement is off (shareEnforcement: none)")
    why = refusal(gpu, time_sliced) or binary_missing or daemon_down
    return Enforcement(MODE_UNENFORCED, why) if why else Enforcement(selected)
