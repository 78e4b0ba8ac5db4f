"""The node's capacity for the fine-grained share resources, from its healthy GPUs.

kube-scheduler's in-tree NodeResourcesFit checks ``kubegpu.io/gpu-core``,
``kubegpu.io/gpu-memory`` and ``kubegpu.io/gpu-memory-ratio`` against the node's
allocatable, so the node daemon advertises them (as ``kubectl patch node
--subresource=status`` does for any extended resource the kubelet does not
manage; the kubelet keeps such entries). Call :func:`publish_capacity` at start
and on every health change: an unhealthy or MIG-enabled GPU offers no share, nor does one whose shares the
node cannot enforce as configured (``unenforced``: MPS selected and its control binary missing), whose share
slots the kubelet holds Unhealthy anyway.
"""

from __future__ import annotations

import logging
import time

import httpx2
from lightkube import Client
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from kubegpu.kube.resources import Node
from kubegpu.model import resources as R
from kubegpu.model.inventory import NodeInventory
from kubegpu.model.quantity import format_bytes
from kubegpu.model.share_enforcement import takes_shares

log = logging.getLogger(__name__)


def share_capacity(inventory: NodeInventory) -> dict[str, str]:
    """Capacity (= allocatable) of the share resources: the sum over the GPUs that may carry shares."""
    usable = [g for g in inventory.gpus if takes_shares(g)]
    return {
        R.GPU_CORE: str(sum(min(100, g.core) for g in usable)),
        R.GPU_MEMORY: format_bytes(sum(g.memory_bytes for g in usable)),
        R.GPU_MEMORY_RATIO: str(100 * len(usable)),
    }


def capacity_patch(inventory: NodeInventory) -> dict[str, object]:
    caps = share_capacity(inventory)
    return {"status": {"capacity": caps, "allocatable": caps}}


def publish_capacity(client: Client, inventory: NodeInventory, *, attempts: int = 3) -> bool:
    """Patch the node's status; True when written. Transient failures are retried, then logged (the
    daemon calls again on the next health change): never raises for an API error."""
    patch = capacity_patch(inventory)
    for attempt in range(attempts):
        try:
            client.patch(Node.Status, inventory.name, patch, patch_type=PatchType.MERGE)
            log.info("node %s: share capacity %s", inventory.name, share_capacity(inventory))
            return True
        except ApiError as e:
            code = getattr(e.status, "code", 0) or 0
            if code == 404:
                log.error("node %s: no such Node object; share capacity not published", inventory.name)
                return False
            if code < 500 and code != 429:
                log.error("node %s: share capacity refused: %s", inventory.name, e.status.message)
                return False
        except (httpx2.HTTPError, OSError) as e:
            log.warning("node %s: API server unreachable (%s)", inventory.name, e)
        time.sleep(0.2 * 2**attempt)
    log.error("node %s: share capacity not published after %d attempts", inventory.name, attempts)
    return False
