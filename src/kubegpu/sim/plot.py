"""The FGD paper's figure 9a: unallocated GPU % against arrived GPU request, one curve per policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kubegpu.sim.study import PolicySummary


def plot_study(results: dict[str, PolicySummary], path: Path | str, title: str = "") -> Path:
    """Write a PNG (mean over seeds, interpolated on a common arrived axis) with the ideal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, 130, 261)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(grid, np.maximum(0, 100 - grid), "k--", linewidth=1, label="ideal")
    for name, s in results.items():
        curves = [np.interp(grid, r.arrived_pct, 100 - r.allocated_pct, left=100.0, right=np.nan) for r in s.runs]
        if not curves:
            continue
        ax.plot(grid, np.nanmean(np.vstack(curves), axis=0), linewidth=1.4, label=name)
    ax.set_xlim(60, 130)
    ax.set_ylim(0, 45)
    ax.set_xlabel("Arrived GPU request (% of capacity)")
    ax.set_ylabel("Unallocated GPU (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
