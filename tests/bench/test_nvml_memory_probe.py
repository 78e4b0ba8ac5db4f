"""``bench/nvml_memory.py`` is run once by hand on a GPU node: here, without NVML, it must still finish,
report why each NVML step failed instead of raising, and print its one JSON object last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_nvml_memory_probe_reports_every_variant_without_a_gpu() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "nvml_memory.py")], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(result["thp"]) >= {"enabled", "defrag"}
    assert set(result["variants"]) == {"default", "thp_disabled", "no_attach"}
    for variant in result["variants"].values():
        steps = [s["step"] for s in variant["steps"]]
        assert steps[0] == "baseline" and all(s["VmRSS"] for s in variant["steps"])
        if "nvml_init" in steps and "error" not in variant["steps"][steps.index("nvml_init")]:
            assert steps[-1] == "nvml_shutdown"  # a GPU node: the whole sequence ran
        else:
            assert variant["steps"][-1].get("error") or steps[-1] == "import_pynvml"
    assert result["variants"]["thp_disabled"].get("prctl_set") == 0


def test_nvml_memory_probe_has_help() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "nvml_memory.py"), "--help"], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0 and "PR_SET_THP_DISABLE" in p.stdout
