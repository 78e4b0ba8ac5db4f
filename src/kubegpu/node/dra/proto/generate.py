"""Regenerate the committed DRA gRPC stubs (kubelet DRA v1 and v1beta1, plugin registration, DRA
health) from the ``.proto`` files beside this script, with the device plugin's generator.

Run: ``python -m kubegpu.node.dra.proto.generate`` (or with ``--check`` to only compare).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kubegpu.node.proto.generate import StubSet

PROTO_DIR = Path(__file__).resolve().parent
STUBS = StubSet(PROTO_DIR, PROTO_DIR.parents[3],
                ("dra_v1.proto", "dra_v1beta1.proto", "pluginregistration.proto", "dra_health.proto"))
stale_files = STUBS.stale_files


if __name__ == "__main__":
    sys.exit(STUBS.main(doc=__doc__))
