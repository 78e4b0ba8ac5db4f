"""The MPS control daemons a node runs to enforce GPU shares (docs/sharing.md).

Start, set defaults, supervise, report readiness; both kubelet paths (device-plugin ``Allocate`` and DRA
``NodePrepareResources``) ask :class:`MpsManager` for a share's pipe and limits and never talk to MPS
themselves. :mod:`.spec` is pure (what a daemon enforces, what a container gets), :mod:`.capability` is
pure (which GPUs can be enforced), :mod:`.control` drives one daemon, :mod:`.manager` owns them all.
"""

from kubegpu.node.mps.capability import (
    ENFORCEMENT_MODES,
    MODE_MPS,
    MODE_NONE,
    MODE_UNENFORCED,
    Enforcement,
    gpu_enforcement,
    refusal,
)
from kubegpu.node.mps.control import MpsControl, MpsError, find_binary
from kubegpu.node.mps.manager import DaemonState, MpsManager
from kubegpu.node.mps.spec import Binding, DaemonSpec, GpuLimit, ShareShapeError, binding, replica_spec, share_spec

__all__ = ["ENFORCEMENT_MODES", "MODE_MPS", "MODE_NONE", "MODE_UNENFORCED", "Binding", "DaemonSpec", "DaemonState",
           "Enforcement", "GpuLimit", "MpsControl", "MpsError", "MpsManager", "ShareShapeError", "binding",
           "find_binary", "gpu_enforcement", "refusal", "replica_spec", "share_spec"]
