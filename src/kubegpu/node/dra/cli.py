"""``kubegpu node --kubelet-plugin dra``: the node served as a DRA driver instead of device plugins.

What differs from the device-plugin node, and only that: the driver's options from the node's one
:class:`~kubegpu.node.config.Config` (its ``kubegpu.dra`` settings, ``--dra-*`` on the command line, beside
the shared ``--cdi-spec-dir``, the Xid policy, ``--health-recovery-interval``, MPS and ``--mps-root``), the
``--dry-run`` listing of the ResourceSlices that would be published, and the daemon. The process around it
(metrics and probes, signals, exit codes) is the node's one lifecycle (:mod:`kubegpu.node.lifecycle`);
SIGHUP discovers the GPUs again (after a MIG reconfiguration) and republishes when they changed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.config import Config, ConfigError

log = logging.getLogger("kubegpu.node.dra")


def dra_options(config: Config, node_name: str) -> Any:
    """The driver's :class:`~kubegpu.node.dra.daemon.DraOptions`; raises ValueError (ConfigError, SliceError)."""
    from kubegpu.node.dra.daemon import DraOptions
    from kubegpu.node.dra.slices import DraSettings

    dra = config.kubegpu.dra
    shared = DraSettings.parse_shared(dra.shared_gpus)
    if shared is not None:
        log.info("--dra-shared-gpus %s: %s take shares beside whole claims; the others whole claims only",
                 dra.shared_gpus, "GPUs " + ",".join(map(str, sorted(shared))) if shared else "no GPU")
    if dra.resync_s <= 0:
        raise ConfigError("--dra-resync: must be more than 0 seconds")
    enforcement = config.kubegpu.share_enforcement
    mps = config.sharing.strategy == "mps" or enforcement != "none"
    settings = DraSettings(node_name=node_name, shared_gpus=shared, mps=mps, mps_root=config.flags.mps_root,
                           mps_binary=config.kubegpu.mps_control_binary, driver_root=config.flags.nvidia_driver_root,
                           enforcement=enforcement if enforcement != "none" else "mps",
                           mps_server_uid=config.kubegpu.mps_server_uid)
    return DraOptions(settings=settings, plugins_dir=dra.plugins_dir, registry_dir=dra.registry_dir,
                      state_dir=dra.state_dir, cdi_dir=config.kubegpu.cdi_spec_dir, xid_policy=config.health,
                      recovery_interval_s=config.kubegpu.health_recovery_interval_s, resync_s=dra.resync_s)


def print_slices(inv: NodeInventory, options: Any, as_json: bool) -> None:
    """``--dry-run``: the ResourceSlices this node would publish (JSON, or one line per slice)."""
    from kubegpu.node.dra.slices import pool_content, slice_bodies

    name = options.settings.node_name
    bodies = slice_bodies(pool_content(replace(inv, name=name), options.settings), options.settings, 1)
    if as_json:
        print(json.dumps(bodies, indent=1))
        return
    for b in bodies:
        devs = b["spec"].get("devices") or []
        print(f"{b['metadata']['name']}: {len(devs)} devices ({', '.join(d['name'] for d in devs)})" if devs else
              f"{b['metadata']['name']}: {len(b['spec'].get('sharedCounters') or [])} counter sets")
