"""Role processes started by the demo end with it, even when it is killed outright.

An orderly stop (:meth:`LocalCluster.stop`) covers Ctrl-C, SIGTERM and failures; a SIGKILL of
the demo leaves nothing of it running to stop anyone. So each child asks the kernel to send it
SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), set by the child itself after exec
(no ``preexec_fn``, which is unsafe in a threaded parent), then checks that the parent it was
started by is still there (it may have died before the request took effect).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "KUBEGPU_DEMO_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Best effort: a no-op where prctl is unavailable."""
    expected = os.environ.get(PARENT_ENV)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if expected and expected.isdigit() and os.getppid() != int(expected):
        raise SystemExit(0)  # the demo is already gone


def run() -> None:
    """``python -c 'from kubegpu.demo.child import run; run()' <kubegpu command and options>``."""
    die_with_parent()
    from kubegpu.cli.main import app

    app(prog_name="kubegpu")
