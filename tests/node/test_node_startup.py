"""kubegpu.node.startup: the daemon that loads NVML keeps transparent huge pages out of its process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kubegpu.node.startup import disable_transparent_huge_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_disable_transparent_huge_pages_in_a_fresh_process() -> None:
    code = ("from kubegpu.node.startup import disable_transparent_huge_pages\n"
            "print(disable_transparent_huge_pages())\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('THP_enabled:')])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    took, status = out.stdout.split("\n", 1)
    assert took == "True"
    assert status.strip() in ("['0']", "[]")  # THP_enabled is shown by kernels from 5.0 on


def test_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert disable_transparent_huge_pages() is False
