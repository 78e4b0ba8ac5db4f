"""``kubegpu node --kubelet-plugin dra``: run the node as a DRA driver instead of device plugins.

Kept apart from ``cli/node.py`` so that command gains one branch only. DRA-only flags (taken out
before the rest goes to the node config loader, which keeps its own validation):

- ``--dra-shared-gpus all|none|0,2-3``: GPUs that take shares beside whole claims (default all;
  ``none`` serves whole GPUs only, as this flag's default did when a shared GPU could not be claimed whole);
- ``--dra-plugins-dir`` (``/var/lib/kubelet/plugins``), ``--dra-registry-dir``
  (``/var/lib/kubelet/plugins_registry``), ``--dra-state-dir`` (default: the plugin's own dir);
- ``--dra-resync`` seconds between full slice reconciles (default 30; the watch repairs sooner).

From the shared config: ``--cdi-spec-dir``, the Xid policy (``DP_DISABLE_HEALTHCHECKS`` ...),
``--health-recovery-interval``, MPS (an ``mps`` sharing section turns on the MPS variables for
shares) and ``--mps-root``. ``--dry-run`` prints the ResourceSlices that would be published.
SIGHUP discovers the GPUs again (after a MIG reconfiguration) and republishes when they changed.
Exit codes as ``kubegpu node``: 0 clean stop, 1 init failure, 2 bad configuration.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

log = logging.getLogger("kubegpu.node.dra")

EXIT_OK, EXIT_INIT, EXIT_CONFIG = 0, 1, 2
DRA_FLAGS = ("dra-shared-gpus", "dra-plugins-dir", "dra-registry-dir", "dra-state-dir", "dra-resync")


def split_flags(flags: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """(DRA flags, the rest for the node config loader)."""
    dra = {k: str(v) for k, v in flags.items() if k in DRA_FLAGS}
    rest = {k: v for k, v in flags.items() if k not in DRA_FLAGS}
    return dra, rest


def build_options(flags: Mapping[str, Any], env: Mapping[str, str], node_name: str) -> Any:
    """DraOptions from flags + env + config file; raises ValueError (ConfigError, SliceError) on bad input."""
    from kubegpu.node.config import load_config
    from kubegpu.node.dra.daemon import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, DraOptions
    from kubegpu.node.dra.slices import DraSettings

    dra, rest = split_flags(flags)
    config = load_config(flags=rest, env=env)
    shared_text = dra.get("dra-shared-gpus", env.get("KUBEGPU_DRA_SHARED_GPUS", "all"))
    shared = DraSettings.parse_shared(shared_text)
    if shared is not None:
        # The flag's meaning changed (it used to make the listed GPUs shares only): say what it does now.
        log.info("--dra-shared-gpus %s: %s take shares beside whole claims; the others whole claims only",
                 shared_text, "GPUs " + ",".join(map(str, sorted(shared))) if shared else "no GPU")
    try:
        resync = float(dra.get("dra-resync", "30"))
    except ValueError:
        raise ValueError(f"--dra-resync {dra['dra-resync']!r}: expected seconds") from None
    if resync <= 0:
        raise ValueError("--dra-resync must be positive")
    mps = config.sharing.strategy == "mps" or config.kubegpu.share_enforcement == "mps"
    settings = DraSettings(node_name=node_name, shared_gpus=shared, mps=mps, mps_root=config.flags.mps_root,
                           mps_binary=config.kubegpu.mps_control_binary, driver_root=config.flags.nvidia_driver_root)
    return DraOptions(settings=settings, plugins_dir=dra.get("dra-plugins-dir", DEFAULT_PLUGINS_DIR),
                      registry_dir=dra.get("dra-registry-dir", DEFAULT_REGISTRY_DIR),
                      state_dir=dra.get("dra-state-dir", ""), cdi_dir=config.kubegpu.cdi_spec_dir,
                      xid_policy=config.health, recovery_interval_s=config.kubegpu.health_recovery_interval_s,
                      resync_s=resync)


def run_dra(flags: Mapping[str, Any], env: Mapping[str, str], *, backend: Any, kubeconfig: str | None,
            node_name: str | None, run_for: float | None, dry_run: bool, as_json: bool) -> int:
    from kubegpu.node.dra.slices import pool_content, slice_bodies

    try:
        inv = backend.discover()
    except Exception as exc:
        log.error("discovery failed: %s", exc)
        return EXIT_INIT
    name = node_name or inv.name
    try:
        opts = build_options(flags, env, name)
    except ValueError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG
    if dry_run:
        bodies = slice_bodies(pool_content(replace(inv, name=name), opts.settings), opts.settings, 1)
        if as_json:
            print(json.dumps(bodies, indent=1))
        else:
            for b in bodies:
                devs = b["spec"].get("devices") or []
                print(f"{b['metadata']['name']}: {len(devs)} devices "
                      f"({', '.join(d['name'] for d in devs)})" if devs else
                      f"{b['metadata']['name']}: {len(b['spec'].get('sharedCounters') or [])} counter sets")
        return EXIT_OK
    from kubegpu.kube.client import make_client
    from kubegpu.node.dra.daemon import DraDaemon

    try:
        client = make_client(kubeconfig)
    except Exception as exc:
        log.error("the DRA driver needs the API server (claims, ResourceSlices): %s", exc)
        return EXIT_INIT
    daemon = DraDaemon(backend, opts, client)
    stop, reload = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    try:
        daemon.start()
    except Exception as exc:
        log.error("DRA driver start failed: %s", exc)
        daemon.stop()
        return EXIT_INIT
    gc.collect()
    gc.freeze()
    deadline = time.monotonic() + run_for if run_for else None
    try:
        while not stop.wait(0.2):
            if reload.is_set():
                reload.clear()
                try:
                    daemon.rediscover()
                except Exception as exc:  # keep serving what was discovered before
                    log.error("rediscovery failed, keeping the published devices: %s", exc)
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        daemon.stop()
        backend.close()
    return EXIT_OK
