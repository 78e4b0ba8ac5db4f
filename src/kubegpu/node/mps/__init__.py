"""The MPS control daemons a node runs to enforce GPU shares (docs/sharing.md).

Start, set defaults, supervise, report readiness; both kubelet paths (device-plugin ``Allocate`` and DRA
``NodePrepareResources``) ask :class:`MpsManager` for a share's pipe and limits and never talk to MPS
themselves. :mod:`.spec` is pure (what a daemon enforces, what a container gets), :mod:`.capability` is
pure (which GPUs can be enforced), :mod:`.control` drives one daemon, :mod:`.manager` owns them all;
:mod:`.compute_mode` and :mod:`.strict` make ``strict`` enforcement (one server per GPU, the GPU exclusive).
"""

from kubegpu.node.mps.capability import (
    ENFORCED_MODES,
    ENFORCEMENT_MODES,
    MODE_MPS,
    MODE_NONE,
    MODE_STRICT,
    MODE_UNENFORCED,
    PER_SHAPE,
    Enforcement,
    gpu_enforcement,
    refusal,
    selected_mode,
)
from kubegpu.node.mps.compute_mode import ComputeModeError, ComputeModeGuard, ComputeModes, GpuMode
from kubegpu.node.mps.control import MpsControl, MpsError, find_binary
from kubegpu.node.mps.manager import DaemonState, MpsManager
from kubegpu.node.mps.spec import Binding, DaemonSpec, GpuLimit, ShareShapeError, binding, replica_spec, share_spec
from kubegpu.node.mps.strict import StrictShares

__all__ = ["ENFORCED_MODES", "ENFORCEMENT_MODES", "MODE_MPS", "MODE_NONE", "MODE_STRICT", "MODE_UNENFORCED",
           "PER_SHAPE", "Binding", "ComputeModeError", "ComputeModeGuard", "ComputeModes", "DaemonSpec", "DaemonState",
           "Enforcement", "GpuLimit", "GpuMode", "MpsControl", "MpsError", "MpsManager", "ShareShapeError",
           "StrictShares", "binding", "find_binary", "gpu_enforcement", "refusal", "replica_spec", "selected_mode",
           "share_spec"]
