"""``kubegpu node`` on a fake topology, with a fault inbox the demo can write to.

A topology file schedules faults at fixed times; the demo needs one at a chosen moment, on a
GPU chosen from the live state. This entry point runs the unchanged ``kubegpu node`` command
and, once it has built its :class:`~kubegpu.inventory.fake.FakeBackend`, follows a JSON-lines
file: each complete line (``{"kind": "xid", "gpu": 1, "xid": 48}``, the topology file's fault
kinds and fields, without ``at``) is applied at once. Bad lines are logged and skipped.

Usage: ``python -m kubegpu.demo.fakenode INBOX node --inventory t4x4 ...``
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubegpu.demo.child import die_with_parent
from kubegpu.inventory.base import InventoryError
from kubegpu.inventory.topology import FAULT_KINDS, Fault

log = logging.getLogger("kubegpu.demo.fakenode")
POLL_S = 0.05


def parse_fault(line: str) -> Fault:
    """One inbox line -> a fault due now; ValueError with the reason otherwise."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("a fault is a JSON object")
    kind = data.get("kind")
    if kind not in FAULT_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
    gpu = data.get("gpu")
    if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, (int, str))):
        raise ValueError(f"gpu {gpu!r} is neither an index nor a UUID")
    xid = data.get("xid", 0)
    if isinstance(xid, bool) or not isinstance(xid, int) or xid < 0:
        raise ValueError(f"xid {xid!r} is not a non-negative integer")
    message = data.get("message", "")
    return Fault(at=0.0, kind=kind, gpu=gpu, xid=xid, message=message if isinstance(message, str) else "")


class FaultInbox:
    """Follows ``path`` and schedules each new fault on ``backend`` (bounded by ``stop``)."""

    def __init__(self, path: Path, backend: Any) -> None:
        self.path, self.backend = path, backend
        self.stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name="fault-inbox", daemon=True)

    def start(self) -> FaultInbox:
        self._thread.start()
        return self

    def poll(self) -> int:
        """Apply the complete lines written since the last poll; returns how many were applied."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n")
        if end < 0:
            return 0  # half a line: wait for the writer to finish it
        self._offset += end + 1
        applied = 0
        for raw in data[:end].splitlines():
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                fault = parse_fault(line)
                self._check_reference(fault)
                self.backend.schedule(fault)
            except (ValueError, InventoryError) as exc:
                log.warning("fault inbox %s: skipping %r: %s", self.path, line[:200], exc)
                continue
            log.info("fault inbox: %s on GPU %s (Xid %s)", fault.kind, fault.gpu, fault.xid or "-")
            applied += 1
        return applied

    def _check_reference(self, fault: Fault) -> None:
        """A fault naming no device of this node is refused here: applied, it would raise inside the
        daemon's health thread."""
        if fault.gpu is None:
            if fault.kind in ("xid", "lost", "recover", "probe-fail"):
                raise ValueError(f"a {fault.kind} fault needs a gpu")
            return
        gpus = self.backend.discover().gpus
        known: set[int | str] = {g.index for g in gpus} | {g.uuid for g in gpus}
        known |= {m.uuid for g in gpus for m in g.mig_devices}
        if fault.gpu not in known:
            raise ValueError(f"no GPU {fault.gpu!r} on this node")

    def _run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.poll()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m kubegpu.demo.fakenode INBOX node [kubegpu node options]", file=sys.stderr)
        raise SystemExit(2)
    inbox = Path(args.pop(0))
    die_with_parent()
    from kubegpu.cli.node_entry import default_backend
    from kubegpu.cli.node_entry import main as node_main
    from kubegpu.inventory.fake import FakeBackend

    def backend_with_inbox(inventory: str | None, node_name: str | None, driver_root: str | None,
                           env: Mapping[str, str]) -> Any:
        backend = default_backend(inventory, node_name, driver_root, env)
        if isinstance(backend, FakeBackend):
            FaultInbox(inbox, backend).start()
        return backend

    if args[:1] != ["node"]:
        print("usage: python -m kubegpu.demo.fakenode INBOX node [kubegpu node options]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(node_main(args[1:], backend_factory=backend_with_inbox))

if __name__ == "__main__":
    main()
