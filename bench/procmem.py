"""A process's resident memory by kind, for the node benchmarks (``bench/node.py``, ``bench/dra.py``).

``rss_mb`` is what the targets are set on. How much of it is anonymous (the process's own: the heap,
Python's objects, what NVML allocates) and how much is file-backed (shared libraries, clean pages the
kernel may drop under a cgroup's limit and read again) tells where a figure can move: read from
``/proc/<pid>/smaps_rollup``.
"""

from __future__ import annotations

from pathlib import Path


def memory_mb(pid: int) -> dict[str, float]:
    """``rss_mb``, ``anon_mb``, ``file_mb`` (resident, not anonymous) and ``pss_mb`` of a live process."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            kb[key] = int(parts[0])
    rss, anon = kb.get("Rss", 0), kb.get("Anonymous", 0)
    return {"rss_mb": round(rss / 1024, 1), "anon_mb": round(anon / 1024, 1), "file_mb": round((rss - anon) / 1024, 1),
            "pss_mb": round(kb.get("Pss", 0) / 1024, 1)}
