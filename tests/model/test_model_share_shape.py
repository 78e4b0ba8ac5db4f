"""The one share-shape rule (what a GPU's MPS server enforces): the node's daemons, the placement core's locks and
the extender's read the same thing, and the node's report of a lock reads back."""

from __future__ import annotations

import numpy as np

from kubegpu.model.share_shape import (
    ShareShape,
    enforced_memory,
    is_whole_part,
    memory_mib,
    parse_shape,
    share_shape,
)
from kubegpu.node.mps.spec import share_spec

GIB = 2**30


def test_a_part_is_keyed_by_what_its_server_enforces() -> None:
    assert share_shape(25, 10 * GIB, 80 * GIB) == ShareShape(25, 10240)
    assert share_shape(0, 10 * GIB, 80 * GIB) == ShareShape(100, 10240)  # memory only: every thread
    assert share_shape(50, 0, 80 * GIB) == ShareShape(50, 81920)  # no memory: all of it
    assert share_shape(25, 10 * GIB + 5, 80 * GIB) == share_shape(25, 10 * GIB, 80 * GIB)  # MiB, as MPS takes it
    assert share_shape(25, 1, 80 * GIB).memory_mib == 1
    assert is_whole_part(100, 0, 80 * GIB) and is_whole_part(0, 80 * GIB, 80 * GIB)
    assert not is_whole_part(100, 40 * GIB, 80 * GIB)


def test_the_memory_rule_applies_elementwise_as_the_placement_core_calls_it() -> None:
    need = np.array([[0, 10 * GIB, 5]], np.int64)
    cap = np.array([[80 * GIB, 80 * GIB, 80 * GIB]], np.int64)
    got = memory_mib(enforced_memory(need, cap))
    assert got.tolist() == [[memory_mib(enforced_memory(int(n), int(c))) for n, c in zip(need[0], cap[0], strict=True)]]
    assert got.tolist() == [[81920, 10240, 1]]


def test_the_node_daemon_key_is_the_rule() -> None:
    spec = share_spec([("GPU-a", 25, 10 * GIB)])
    assert spec.shape_on("GPU-a") == share_shape(25, 10 * GIB, 80 * GIB)
    wide = share_spec([("GPU-a", 25, 10 * GIB), ("GPU-b", 25, 10 * GIB)])
    assert wide.shape_on("GPU-b") == ShareShape(25, 10240, 2)


def test_a_reported_lock_reads_back() -> None:
    for shape in (ShareShape(25, 10240), ShareShape(100, 1, 3)):
        assert parse_shape(shape.describe()) == shape
    assert ShareShape(25, 10240).describe() == "25% / 10240M"
    assert ShareShape(25, 10240).human() == "25 percent / 10Gi"
    assert ShareShape(25, 1000).human() == "25 percent / 1000Mi"
    assert parse_shape("") is None and parse_shape("25% / 4096M,4096M") is None
