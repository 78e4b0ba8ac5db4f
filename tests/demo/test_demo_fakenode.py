"""The fault inbox of ``kubegpu.demo.fakenode``: lines become faults on the fake backend; bad lines are
skipped; and through the real ``kubegpu node`` process an Xid written there reaches the kubelet."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubegpu.demo.fakenode import FaultInbox, parse_fault
from kubegpu.inventory.fake import FakeBackend
from kubegpu_standins.kubelet import StandinKubelet


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgf-", dir="/tmp"))  # unix socket paths must stay short
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_parse_fault_accepts_the_topology_kinds() -> None:
    f = parse_fault('{"kind": "xid", "gpu": 1, "xid": 48, "message": "ECC"}')
    assert (f.at, f.kind, f.gpu, f.xid, f.message) == (0.0, "xid", 1, 48, "ECC")
    assert parse_fault('{"kind": "lost", "gpu": "GPU-x"}').gpu == "GPU-x"


@pytest.mark.parametrize("line, why", [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"kind": "melt", "gpu": 1}', "kind"),
    ('{"kind": "xid", "gpu": true, "xid": 48}', "gpu"),
    ('{"kind": "xid", "gpu": 1, "xid": -3}', "xid"),
])
def test_parse_fault_refuses_bad_lines(line: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_fault(line)


def test_inbox_applies_complete_lines_and_skips_bad_ones(short_dir: Path) -> None:
    backend = FakeBackend("t4x4", node_name="n1")
    uuid = backend.discover().gpus[1].uuid
    inbox = short_dir / "faults.jsonl"
    reader = FaultInbox(inbox, backend)
    assert reader.poll() == 0  # no file yet
    with inbox.open("a") as f:
        f.write('garbage\n{"kind": "xid", "gpu": 9, "xid": 48}\n{"kind": "xid", "gpu": 1, "xid": 48}\n{"kind": "x')
    assert reader.poll() == 1  # the GPU 9 line is a bad reference, the last line is not finished
    event = backend.wait_event(2.0)
    assert event is not None and event.uuid == uuid and event.xid == 48
    with inbox.open("a") as f:
        f.write('id", "gpu": 2, "xid": 79}\n')
    assert reader.poll() == 1
    event = backend.wait_event(2.0)
    assert event is not None and event.xid == 79
    backend.close()


def test_xid_through_the_inbox_reaches_the_kubelet(short_dir: Path) -> None:
    kubelet = StandinKubelet(short_dir / "dp")
    kubelet.start()
    inbox = short_dir / "faults.jsonl"
    inbox.touch()
    log = (short_dir / "node.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "kubegpu.demo.fakenode", str(inbox), "node", "--standalone",
                             "--inventory", "t4x4", "--node-name", "n1", "--device-plugin-dir", str(short_dir / "dp"),
                             "--metrics-address", "off", "--health-recovery-interval", "0"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=30), (short_dir / "node.log").read_text()
        assert kubelet.wait_for(lambda: len(kubelet.healthy("nvidia.com/gpu")) == 4, 10)
        uuid = FakeBackend("t4x4", node_name="n1").discover().gpus[3].uuid
        with inbox.open("a") as f:
            f.write(json.dumps({"kind": "xid", "gpu": 3, "xid": 48}) + "\n")
        assert kubelet.wait_for(lambda: uuid in kubelet.unhealthy("nvidia.com/gpu"), 10), \
            (short_dir / "node.log").read_text()
        assert kubelet.allocatable("nvidia.com/gpu") == 3
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        kubelet.stop()
