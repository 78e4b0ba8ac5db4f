"""Where NVML's resident memory comes from: a probe to run once on a real GPU node.

Measured on an H200, ``nvmlInit`` alone adds about 18 MB to a Python process, most of it one 16 MB
anonymous mapping that the driver's library allocates and fills. One hypothesis to check: that
mapping is resident in full because transparent huge pages back it. If so, the node daemon could set
``PR_SET_THP_DISABLE`` for itself at start-up.

A second hypothesis: the driver's library allocates that state per GPU when it attaches to every GPU at
``nvmlInit``; ``nvmlInitWithFlags(NVML_INIT_FLAG_NO_ATTACH)`` defers the attach to the first use of each
GPU. Whether that saves anything once every GPU has been used (as the daemon uses them all) is what the
``devices`` and ``events`` steps of that variant show.

This probe runs the same sequence of steps in three fresh Python processes, each its own subprocess:

- ``default``: as the daemon runs today;
- ``thp_disabled``: ``prctl(PR_SET_THP_DISABLE, 1)`` set first, before anything is loaded;
- ``no_attach``: ``nvmlInitWithFlags(NVML_INIT_FLAG_NO_ATTACH)`` instead of ``nvmlInit``.

The steps: ``baseline``; ``import_pynvml``; ``load_library`` (pynvml loads ``libnvidia-ml.so.1``
without initialising it); ``nvml_init``; ``devices`` (every device's handle, and its name, memory
info and UUID queried once); ``events`` (an event set created and every GPU registered for Xid and
ECC events, as :mod:`kubegpu.inventory.nvml` does); ``nvml_shutdown``. After each: ``VmRSS`` from
``/proc/self/status`` and ``Rss``, ``Pss``, ``Anonymous`` and ``AnonHugePages`` from
``/proc/self/smaps_rollup`` (kB). Also, for ``nvml_init``, each mapping whose resident size grew by at
least ``--min-growth-kb`` (address range, size, Rss and AnonHugePages before and after, path), and
for each variant the process's THP state as the kernel reports it (``THP_enabled`` in
``/proc/self/status``).

The kernel's settings (``/sys/kernel/mm/transparent_hugepage/enabled`` and ``defrag``) are read once.
An NVML error at any step is reported in that step (``error``) and the probe goes on to the next
step it can still run; it never raises. Needs ``nvidia-ml-py`` (``pynvml``) and the NVIDIA driver.

The last line of stdout is one JSON object: ``{"thp": {...}, "variants": {"default": {...},
"thp_disabled": {...}, "no_attach": {...}}, "summary": {...}}``; ``summary`` gives each variant's growth at
``nvml_init`` (VmRSS, AnonHugePages) and its VmRSS once every GPU is registered for events (what the
daemon holds) for a quick comparison.

Usage: ``python bench/nvml_memory.py [--min-growth-kb 256] [--timeout 120]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PR_SET_THP_DISABLE = 41  # linux/prctl.h
PR_GET_THP_DISABLE = 42
XID_EVENTS = 0x8  # nvmlEventTypeXidCriticalError
ECC_EVENTS = 0x1 | 0x2  # nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError
ROLLUP_FIELDS = ("Rss", "Pss", "Anonymous", "AnonHugePages")
VARIANTS = ("default", "thp_disabled", "no_attach")


def read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def memory() -> dict[str, int | None]:
    """VmRSS and the smaps_rollup fields of this process, in kB."""
    out: dict[str, int | None] = {"VmRSS": None, **{f: None for f in ROLLUP_FIELDS}}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["VmRSS"] = int(line.split()[1])
    except OSError:
        pass
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if parts and parts[0].rstrip(":") in ROLLUP_FIELDS:
                out[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        pass
    return out


def mappings() -> dict[str, dict[str, Any]]:
    """Every mapping of this process by address range: size, Rss, AnonHugePages (kB), perms, path."""
    out: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if not parts[0].endswith(":") and "-" in parts[0]:
            current = {"perms": parts[1] if len(parts) > 1 else "",
                       "path": " ".join(parts[5:]) if len(parts) > 5 else "[anon]"}
            out[parts[0]] = current
        elif current is not None and parts[0] in ("Size:", "Rss:", "AnonHugePages:"):
            current[parts[0].rstrip(":")] = int(parts[1])
    return out


def grown(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
          min_kb: int) -> list[dict[str, Any]]:
    """Mappings whose Rss grew by at least ``min_kb`` (new mappings included), largest first."""
    rows = []
    for rng, m in after.items():
        old = before.get(rng, {})
        growth = m.get("Rss", 0) - old.get("Rss", 0)
        if growth >= min_kb:
            rows.append({"range": rng, "path": m["path"], "perms": m["perms"], "size_kb": m.get("Size", 0),
                         "rss_kb": m.get("Rss", 0), "rss_before_kb": old.get("Rss"),
                         "anon_huge_kb": m.get("AnonHugePages", 0),
                         "anon_huge_before_kb": old.get("AnonHugePages"), "new": rng not in before})
    return sorted(rows, key=lambda r: -(r["rss_kb"] - (r["rss_before_kb"] or 0)))


def thp_status() -> str | None:
    """``THP_enabled`` from /proc/self/status (1: huge pages allowed for this process), where shown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("THP_enabled:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def child(variant: str, min_kb: int) -> dict[str, Any]:
    """The sequence of steps in this (fresh) process; every failure is recorded, none raised."""
    result: dict[str, Any] = {"variant": variant, "pid": os.getpid(), "steps": []}
    if variant == "thp_disabled":
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)
            result["prctl_set"] = rc if rc == 0 else f"failed: errno {ctypes.get_errno()}"
            result["prctl_get"] = libc.prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0)
        except Exception as exc:
            result["prctl_set"] = _error(exc)
    result["thp_enabled_status"] = thp_status()
    steps: list[dict[str, Any]] = result["steps"]

    def step(name: str, error: str | None = None, **extra: Any) -> None:
        entry: dict[str, Any] = {"step": name, **memory(), **extra}
        if error:
            entry["error"] = error
        steps.append(entry)

    step("baseline")
    try:
        import pynvml  # type: ignore[import-untyped]
    except Exception as exc:
        step("import_pynvml", _error(exc))
        return result
    step("import_pynvml")

    loader = getattr(pynvml, "_LoadNvmlLibrary", None)
    if loader is None:
        step("load_library", "pynvml has no _LoadNvmlLibrary: the library loads at nvmlInit")
    else:
        try:
            loader()
            step("load_library")
        except Exception as exc:
            step("load_library", _error(exc))

    before = mappings()
    try:
        if variant == "no_attach":
            pynvml.nvmlInitWithFlags(pynvml.NVML_INIT_FLAG_NO_ATTACH)
        else:
            pynvml.nvmlInit()
    except Exception as exc:
        step("nvml_init", _error(exc))
        return result
    step("nvml_init")
    result["grown_at_nvml_init"] = grown(before, mappings(), min_kb)

    handles = []
    devices: list[dict[str, Any]] = []
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        count = 0
        devices.append({"error": _error(exc)})
    for i in range(count):
        d: dict[str, Any] = {"index": i}
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            for key, fn in (("name", pynvml.nvmlDeviceGetName), ("uuid", pynvml.nvmlDeviceGetUUID)):
                try:
                    v = fn(h)
                    d[key] = v.decode() if isinstance(v, bytes) else v
                except Exception as exc:
                    d[key] = _error(exc)
            try:
                d["memory_total"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            except Exception as exc:
                d["memory_total"] = _error(exc)
        except Exception as exc:
            d["error"] = _error(exc)
        devices.append(d)
    step("devices", devices=devices)

    event_set = None
    registered: list[Any] = []
    try:
        event_set = pynvml.nvmlEventSetCreate()
        for h in handles:
            try:
                mask = (XID_EVENTS | ECC_EVENTS) & int(pynvml.nvmlDeviceGetSupportedEventTypes(h))
                if mask & XID_EVENTS:
                    pynvml.nvmlDeviceRegisterEvents(h, mask, event_set)
                    registered.append(mask)
                else:
                    registered.append("no Xid events on this GPU")
            except Exception as exc:
                registered.append(_error(exc))
        step("events", registered=registered)
    except Exception as exc:
        step("events", _error(exc))

    if event_set is not None:
        try:
            pynvml.nvmlEventSetFree(event_set)
        except Exception as exc:
            result["event_set_free_error"] = _error(exc)
    try:
        pynvml.nvmlShutdown()
        step("nvml_shutdown")
    except Exception as exc:
        step("nvml_shutdown", _error(exc))
    return result


def run_variant(variant: str, min_kb: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--min-growth-kb", str(min_kb)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"did not finish within {timeout} s"}
    lines = out.stdout.strip().splitlines()
    try:
        data: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"variant": variant, "error": f"exit {out.returncode}, no JSON: {out.stderr[-2000:]}"}
    if out.returncode != 0 or out.stderr.strip():
        data["stderr"] = out.stderr[-2000:]
    return data


def summary(variant: dict[str, Any]) -> dict[str, Any]:
    by = {s["step"]: s for s in variant.get("steps", [])}
    init, before = by.get("nvml_init"), by.get("load_library") or by.get("import_pynvml")
    if not init or not before or "error" in init:
        return {"error": (init or {}).get("error") or variant.get("error") or "nvmlInit not reached"}
    return {f"{k}_growth_at_init_kb": (init[k] - before[k]) if init[k] is not None and before[k] is not None
            else None for k in ("VmRSS", "Anonymous", "AnonHugePages")} | {
        "VmRSS_after_events_kb": (by.get("events") or {}).get("VmRSS"),
        "VmRSS_final_kb": variant["steps"][-1].get("VmRSS")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-growth-kb", type=int, default=256,
                    help="report mappings whose Rss grew at nvmlInit by at least this much (default 256)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds each variant may take (default 120)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.min_growth_kb)))
        return
    thp = {name: read_text(f"/sys/kernel/mm/transparent_hugepage/{name}")
           for name in ("enabled", "defrag", "khugepaged/defrag")}
    variants = {v: run_variant(v, a.min_growth_kb, a.timeout) for v in VARIANTS}
    for v, data in variants.items():
        print(f"{v}: {json.dumps(summary(data))}", file=sys.stderr)
    print(json.dumps({"thp": thp, "variants": variants, "summary": {v: summary(d) for v, d in variants.items()},
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
