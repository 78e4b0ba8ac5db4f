"""MIG profile names and attributes, shared by the NVML backend and the topology files.

The name rule is NVIDIA go-nvlib's (contracts.md §6.2), so a MIG device gets the same
``<g>g.<GB>gb`` name here as in NVIDIA's device plugin and GFD, and therefore the same
``nvidia.com/mig-<profile>`` resource. The attribute table gives the fake backend the
figures NVML would report (SM count, slices, engines) for the common data-centre parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_MIB: Final = 2**20
_GIB: Final = 2**30

PROFILE_RE: Final = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<suffix>(?:[+-][a-z]+)*)$")


def memory_gb(mig_memory_mib: int, total_memory_bytes: int) -> int:
    """go-nvlib's GB figure: the MIG share of memory rounded up to 1/8, times the GPU's GiB."""
    if mig_memory_mib <= 0 or total_memory_bytes <= 0:
        raise ValueError("MIG and GPU memory must be positive")
    # Exact integer arithmetic (no fractions module: it loads decimal, memory the node daemon would hold for nothing).
    eighths = -(-(mig_memory_mib * _MIB * 8) // total_memory_bytes)  # ceil(share * 8)
    gib = -(-total_memory_bytes // _GIB)  # ceil
    # eighths / 8 * gib rounded half away from zero (all positive), as Go's math.Round does
    return (eighths * gib + 4) // 8


def profile_name(gi_slices: int, ci_slices: int, mig_memory_mib: int, total_memory_bytes: int,
                 suffix: str = "") -> str:
    """``3g.40gb``, or ``1c.3g.40gb`` when the compute instance is smaller than its GPU instance."""
    gb = memory_gb(mig_memory_mib, total_memory_bytes)
    base = f"{gi_slices}g.{gb}gb" if ci_slices == gi_slices else f"{ci_slices}c.{gi_slices}g.{gb}gb"
    return base + suffix


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """What NVML reports for one MIG profile on one GPU model."""

    memory_mib: int
    multiprocessors: int
    copy: int
    decoder: int
    encoder: int
    jpeg: int
    ofa: int

    def attributes(self, gi_slices: int, ci_slices: int) -> dict[str, int]:
        """The attribute set in GFD's label vocabulary."""
        return {
            "multiprocessors": self.multiprocessors * ci_slices // gi_slices if gi_slices else 0,
            "slices.gi": gi_slices,
            "slices.ci": ci_slices,
            "engines.copy": self.copy,
            "engines.decoder": self.decoder,
            "engines.encoder": self.encoder,
            "engines.jpeg": self.jpeg,
            "engines.ofa": self.ofa,
        }


# GPU-instance profiles by model, from NVIDIA's MIG user guide tables (memory in MiB as NVML
# reports memorySizeMB). Keyed by the profile's name without a compute-slice prefix.
PROFILES: Final[dict[str, dict[str, ProfileSpec]]] = {
    "NVIDIA A100-SXM4-40GB": {
        "1g.5gb": ProfileSpec(4864, 14, 1, 0, 0, 0, 0),
        "1g.5gb+me": ProfileSpec(4864, 14, 1, 1, 0, 1, 1),
        "1g.10gb": ProfileSpec(9856, 14, 1, 1, 0, 0, 0),
        "2g.10gb": ProfileSpec(9856, 28, 2, 1, 0, 0, 0),
        "3g.20gb": ProfileSpec(19968, 42, 3, 2, 0, 0, 0),
        "4g.20gb": ProfileSpec(19968, 56, 4, 2, 0, 0, 0),
        "7g.40gb": ProfileSpec(40192, 98, 7, 5, 0, 1, 1),
    },
    "NVIDIA A100-SXM4-80GB": {
        "1g.10gb": ProfileSpec(9728, 14, 1, 0, 0, 0, 0),
        "1g.10gb+me": ProfileSpec(9728, 14, 1, 1, 0, 1, 1),
        "1g.20gb": ProfileSpec(19968, 14, 1, 1, 0, 0, 0),
        "2g.20gb": ProfileSpec(19968, 28, 2, 1, 0, 0, 0),
        "3g.40gb": ProfileSpec(40192, 42, 3, 2, 0, 0, 0),
        "4g.40gb": ProfileSpec(40192, 56, 4, 2, 0, 0, 0),
        "7g.80gb": ProfileSpec(80384, 98, 7, 5, 0, 1, 1),
    },
    "NVIDIA H100 80GB HBM3": {
        "1g.10gb": ProfileSpec(9984, 16, 1, 1, 0, 1, 0),
        "1g.10gb+me": ProfileSpec(9984, 16, 1, 1, 0, 1, 1),
        "1g.20gb": ProfileSpec(19968, 26, 1, 1, 0, 1, 0),
        "2g.20gb": ProfileSpec(19968, 32, 2, 2, 0, 2, 0),
        "3g.40gb": ProfileSpec(40448, 60, 3, 3, 0, 3, 0),
        "4g.40gb": ProfileSpec(40448, 64, 4, 4, 0, 4, 0),
        "7g.80gb": ProfileSpec(80896, 132, 8, 7, 0, 7, 1),
    },
}


def profile_spec(model: str, profile: str) -> ProfileSpec | None:
    """The table entry for a profile (a ``<c>c.`` prefix is looked up by its GPU instance)."""
    m = PROFILE_RE.match(profile)
    if m is None:
        return None
    gi_profile = f"{m['g']}g.{m['gb']}gb{m['suffix']}"
    return PROFILES.get(model, {}).get(gi_profile)


def slices(profile: str) -> tuple[int, int]:
    """(GPU-instance slices, compute-instance slices) of a profile name."""
    m = PROFILE_RE.match(profile)
    if m is None:
        raise ValueError(f"{profile!r} is not a MIG profile name")
    g = int(m["g"])
    return g, int(m["c"]) if m["c"] else g
