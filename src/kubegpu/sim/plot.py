"""The FGD paper's figure 9a: unallocated GPU % against arrived GPU request, one curve per policy.

Drawn for an operator to read and show: the left panel is the paper's view (arrived 60–130 %); the right
panel zooms on arrived ≥ 100 %, where the ideal is 0 and every point above it is GPU stranded by the policy,
with a y-scale fitted to where the policies differ. Each policy has its own colour, line style and marker;
with several seeds the line is the mean and a band spans the seeds' min–max. Lower is better.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from kubegpu.sim.study import PolicySummary

GRID = np.linspace(0, 130, 261)  # arrived GPU request, % of capacity, every 0.5 %
ZOOM_FROM = 100.0  # arrived % where the ideal reaches 0: the zoomed panel's left edge
MARKS_AT = (80, 90, 100, 110, 120, 130)  # the paper's checkpoints get a marker
HEADLINE = 100.0  # arrived % of the table's headline column and the paper's "@100": the labels' values
HEADLINE_INDEX = int(np.argmin(np.abs(GRID - HEADLINE)))
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")
HIGHLIGHT = "kubegpu"  # drawn thicker, on top


def curves(summary: PolicySummary) -> np.ndarray:
    """One row per seed: unallocated GPU % on :data:`GRID` (NaN past the run's last arrival)."""
    rows = [np.interp(GRID, r.arrived_pct, 100 - r.allocated_pct, left=100.0, right=np.nan) for r in summary.runs]
    return np.vstack(rows) if rows else np.empty((0, len(GRID)))


def _zoom_limits(stats: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """y-limits of the zoomed panel: every band's min and max over arrived ≥ ZOOM_FROM, padded."""
    window = GRID >= ZOOM_FROM
    lows = [np.nanmin(lo[window]) for _, lo, _ in stats if np.isfinite(lo[window]).any()]
    highs = [np.nanmax(hi[window]) for _, _, hi in stats if np.isfinite(hi[window]).any()]
    if not lows:
        return 0.0, 45.0
    lo, hi = min(lows), max(highs)
    pad = max(0.5, 0.08 * (hi - lo))
    return max(0.0, lo - pad), hi + pad


def build_figure(results: dict[str, PolicySummary], title: str = "") -> Any:
    """The figure (a matplotlib ``Figure``), for :func:`plot_study` and for tests to inspect."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120, gridspec_kw={"width_ratios": [1, 1.25]})
    ideal = np.maximum(0, 100 - GRID)
    stats: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    names: list[str] = []
    ends: list[tuple[float, float, str, str]] = []
    seeds = 0
    for name, s in results.items():
        c = curves(s)
        if not len(c):
            continue
        seeds = max(seeds, len(c))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns past the last arrival
            stats.append((np.nanmean(c, axis=0), np.nanmin(c, axis=0), np.nanmax(c, axis=0)))
        names.append(name)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # matplotlib's default ten
    for ax in (full, zoom):
        ax.plot(GRID, ideal, color="0.2", linestyle=(0, (1, 1)), linewidth=1, label="ideal (no stranding)")
        for i, (name, (mean, lo, hi)) in enumerate(zip(names, stats, strict=True)):
            top = name == HIGHLIGHT
            # Markers staggered by policy, so two close curves still show both.
            marks = [int(np.argmin(np.abs(GRID - (x + (i % 4) * 1.5 - 2.25)))) for x in MARKS_AT]
            style = dict(color=colours[i % len(colours)], linestyle=_STYLES[i % len(_STYLES)],
                         marker=_MARKERS[i % len(_MARKERS)], markevery=marks, markersize=5 if top else 4,
                         linewidth=2.4 if top else 1.3, zorder=4 if top else 3)
            ax.plot(GRID, mean, label=name + (f" (mean of {len(curves(results[name]))} seeds)"
                                               if seeds > 1 and ax is full else ""), **style)
            if seeds > 1:
                ax.fill_between(GRID, lo, hi, color=style["color"], alpha=0.15, linewidth=0, zorder=2)
            if ax is zoom:
                # Named at the right end (where the curve is), with its value at the headline's point:
                # arrived 100 %, the table's and the paper's "@100" (not the 130 % the replay runs on to).
                ends.append((float(np.nanmean(mean[GRID >= 125])), float(mean[HEADLINE_INDEX]), name, style["color"]))
        ax.grid(alpha=0.3)
        ax.set_xlabel("Arrived GPU request (% of cluster GPU capacity)")
    full.set_xlim(60, 130)
    full.set_ylim(0, 45)
    full.set_ylabel("Unallocated GPU (%) — lower is better")
    full.set_title("the paper's view (figure 9a)", fontsize=9)
    full.axvspan(ZOOM_FROM, 130, color="0.9", zorder=0)
    zoom.set_xlim(ZOOM_FROM, 130)
    low, high = _zoom_limits(stats)
    zoom.set_ylim(low, high)
    # Each curve named at its right end with its value at arrived 100 %, nudged apart where they crowd.
    gap = 0.045 * (high - low)
    placed: list[float] = []
    for end, at_headline, name, colour in sorted(e for e in ends if np.isfinite(e[0])):
        y = max(end, placed[-1] + gap) if placed else end
        placed.append(y)
        value = f"{at_headline:.1f} % @{HEADLINE:g}" if np.isfinite(at_headline) else "-"
        zoom.annotate(f"{name} {value}", xy=(130, end), xytext=(133, y), textcoords="data",
                      color=colour, fontsize=8, va="center", annotation_clip=False,
                      arrowprops=dict(arrowstyle="-", color=colour, linewidth=0.6))
    zoom.set_ylabel("Unallocated GPU (%) — lower is better")
    band = " · bands: min–max over seeds" if seeds > 1 else " · one seed (no band; --seeds N adds min–max bands)"
    zoom.set_title(f"zoom: demand ≥ capacity, where policies differ{band}", fontsize=9)
    full.legend(fontsize=7.5, loc="upper right")
    fig.suptitle(("GPU left unallocated as demand grows" + (f" — {title}" if title else "")), fontsize=10)
    fig.tight_layout()
    return fig


def plot_study(results: dict[str, PolicySummary], path: Path | str, title: str = "") -> Path:
    """Write the PNG (see the module's docstring) and return its path."""
    import matplotlib.pyplot as plt

    fig = build_figure(results, title)
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
