"""Whether a node can hold shares to their limits as configured, read from its GPUs as it reports them.

The node daemon marks each GPU's share enforcement (:attr:`kubegpu.model.inventory.Gpu.share_enforcement`):
``unenforced`` when enforcement is selected but not possible (MPS selected and its control binary missing, a
pre-Volta GPU). The node daemon advertises no share capacity on such GPUs, and the extender tells a pod asking a
share why such a node cannot take it: both read it here, so they say the same thing.
"""

from __future__ import annotations

from kubegpu.model.inventory import Gpu, NodeInventory

UNENFORCED = "unenforced"
STRICT = "strict"  # one MPS server per GPU, the GPU exclusive, one share shape at a time (docs/sharing.md)


def takes_shares(g: Gpu) -> bool:
    """Whether the GPU may carry shares: healthy, not split into MIG devices, and its shares enforceable."""
    return g.healthy and not g.mig_enabled and g.share_enforcement != UNENFORCED


def is_strict(g: Gpu) -> bool:
    """Whether the node enforces the GPU's shares strictly: placement then keeps to its shape lock."""
    return g.share_enforcement == STRICT


def unenforced_reason(inventory: NodeInventory) -> str:
    """Why no GPU of the node can take a share because shares cannot be enforced there ('' when one can, or
    when the node's GPUs are out of shares for another reason: unhealthy, MIG)."""
    candidates = [g for g in inventory.gpus if g.healthy and not g.mig_enabled]
    if not candidates or any(takes_shares(g) for g in candidates):
        return ""
    reasons = sorted({g.share_enforcement_reason for g in candidates if g.share_enforcement_reason})
    why = "; ".join(reasons) if reasons else "its GPUs report shares as unenforced"
    return f"node {inventory.name} cannot enforce shares: {why}"
