"""A stand-in ``nvidia-ctk`` for tests: records its arguments and writes a CDI spec shaped like the real one's.

Installed by :func:`install` as an executable script; ``cdi generate`` writes, for the device names listed in
``<script>.devices.json``, device nodes under ``--dev-root``, the driver libraries it finds under
``--driver-root`` as mounts (none found: no mounts, as the real tool on a node without a driver), and an
ldcache hook at ``--nvidia-cdi-hook-path``. ``<script>.fail`` makes it exit 1 with that file's text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LIBDIR = "usr/lib/x86_64-linux-gnu"
LIBS = ("libcuda.so.550.54.15", "libnvidia-ml.so.550.54.15")


def main(argv: list[str]) -> int:
    me = Path(argv[0])
    with open(f"{me}.calls.jsonl", "a") as f:
        f.write(json.dumps(argv[1:]) + "\n")
    fail = Path(f"{me}.fail")
    if fail.exists():
        sys.stderr.write(fail.read_text())
        return 1
    if argv[1:3] != ["cdi", "generate"]:
        sys.stderr.write(f"unknown command {argv[1:3]}\n")
        return 2
    opts: dict[str, list[str]] = {}
    for a in argv[3:]:
        key, _, value = a.partition("=")
        opts.setdefault(key.lstrip("-"), []).append(value)
    driver_root, dev_root = opts["driver-root"][0], opts["dev-root"][0]
    names = json.loads(Path(f"{me}.devices.json").read_text())

    def node(path: str) -> dict[str, str]:
        return {"path": path, "hostPath": str(Path(dev_root) / path.lstrip("/"))}

    devices = [{"name": n, "containerEdits": {"deviceNodes": [node(f"/dev/nvidia{minor}")]}}
               for n, minor in names]
    mounts = [{"hostPath": str(Path(driver_root) / LIBDIR / lib), "containerPath": f"/{LIBDIR}/{lib}",
               "options": ["ro", "nosuid", "nodev", "bind"]}
              for lib in LIBS if (Path(driver_root) / LIBDIR / lib).exists()]
    edits: dict = {"deviceNodes": [node("/dev/nvidiactl"), node("/dev/nvidia-uvm")],
                   "env": ["NVIDIA_VISIBLE_DEVICES=void"]}
    if mounts:
        edits["mounts"] = mounts
        edits["hooks"] = [{"hookName": "createContainer", "path": opts["nvidia-cdi-hook-path"][0],
                           "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", f"/{LIBDIR}"]}]
    spec = {"cdiVersion": "0.6.0", "kind": f"{opts['vendor'][0]}/{opts['class'][0]}", "devices": devices,
            "containerEdits": edits}
    Path(opts["output"][0]).write_text(json.dumps(spec))
    return 0


def install(driver_root: Path, ctk_path: str, devices: list[tuple[str, int]], *, with_driver: bool = True) -> Path:
    """Put the stand-in at ``<driver_root>/<ctk_path>`` (the host's toolkit as the node container sees it)."""
    script = driver_root / ctk_path.lstrip("/")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    script.chmod(0o755)
    Path(f"{script}.devices.json").write_text(json.dumps(devices))
    if with_driver:
        (driver_root / LIBDIR).mkdir(parents=True, exist_ok=True)
        for lib in LIBS:
            (driver_root / LIBDIR / lib).write_bytes(b"\x7fELF")
    return script


def calls(script: Path) -> list[list[str]]:
    path = Path(f"{script}.calls.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    sys.exit(main(sys.argv))
