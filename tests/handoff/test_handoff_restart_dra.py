"""The DRA driver's restart: a stopping driver publishes every device tainted before its plugin goes, so the
scheduler allocates nothing here that the kubelet could not prepare; the next driver offers them again only
once the kubelet has registered it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node.dra.dra_harness import make_bed  # the DRA stand-ins' bed (tests/node/dra)

from kubegpu.node.dra.names import DRIVER, TAINT_RESTARTING


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgdr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def taint_keys(slices: list[dict[str, Any]]) -> list[set[str]]:
    """Per published device, the keys of its taints."""
    return [{t["key"] for t in d.get("taints") or []} for s in slices for d in (s.get("spec") or {}).get("devices", [])]


def test_a_stopping_dra_driver_withdraws_its_devices_and_the_next_offers_them_once_registered(root: Path) -> None:
    bed = make_bed(root)
    try:
        first = bed.start_daemon()
        assert bed.wait(lambda: DRIVER in bed.kubelet.plugins and len(bed.slices()) == 1)
        keys = taint_keys(bed.slices())
        assert keys and all(TAINT_RESTARTING not in k for k in keys)
        bed.stop_daemon()
        # Withdrawn before the plugin went: every device carries the taint (the slices stay until the kubelet's
        # grace period wipes them).
        keys = taint_keys(bed.slices())
        assert keys and all(TAINT_RESTARTING in k for k in keys)
        second = bed.start_daemon()
        assert second is not first
        assert bed.wait(lambda: second.plugin is not None and second.plugin.registered and bool(bed.slices())
                        and all(TAINT_RESTARTING not in k for k in taint_keys(bed.slices())), 30)
    finally:
        bed.close()
