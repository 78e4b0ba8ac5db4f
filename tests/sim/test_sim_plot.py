"""The simulator's figure: a y-scale fitted to where policies differ, distinguishable curves, min–max bands
over seeds, and "lower is better" on it."""

from __future__ import annotations

from typing import Any

import numpy as np

from kubegpu.sim.plot import build_figure, plot_study
from kubegpu.sim.replay import ReplayResult
from kubegpu.sim.study import PolicySummary


def run(policy: str, seed: int, plateau: float) -> ReplayResult:
    """A replay whose unallocated GPU follows the ideal until ~95 % arrived, then stays at ``plateau`` %."""
    arrived = np.linspace(0, 130, 400)
    allocated = np.minimum(arrived, 100 - plateau)
    return ReplayResult(policy, policy, seed, len(arrived), arrived, allocated, {}, {}, 0.0)


def study(seeds: int) -> dict[str, PolicySummary]:
    plateaus = {"random": 12.0, "packing": 8.3, "clustering": 8.4, "fgd": 4.5, "kubegpu": 3.9}
    return {name: PolicySummary(name, name, [run(name, 42 + k, p + 0.2 * k) for k in range(seeds)])
            for name, p in plateaus.items()}


def _lines(ax: Any) -> list[Any]:
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("ideal")]


def test_zoom_scale_curves_and_labels() -> None:
    fig = build_figure(study(1), "test")
    full, zoom = fig.axes
    low, high = zoom.get_ylim()
    assert 2.5 < low < 3.9 and 12.0 < high < 13.5  # fitted to the 3.9–12 % band, not 0–45
    assert zoom.get_xlim() == (100.0, 130.0) and full.get_ylim() == (0.0, 45.0)
    for ax in (full, zoom):
        assert "lower is better" in ax.get_ylabel()
    styles = {(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in _lines(zoom)}
    assert len(styles) == 5  # no two policies drawn alike
    assert {t.get_text().split()[0] for t in zoom.texts} == {"random", "packing", "clustering", "fgd", "kubegpu"}

    assert not zoom.collections  # one seed: no band
    assert "one seed" in zoom.get_title()


def test_seed_bands_span_min_to_max() -> None:
    fig = build_figure(study(3), "")
    zoom = fig.axes[1]
    assert len(zoom.collections) == 5 and "min–max over seeds" in zoom.get_title()
    kubegpu_band = zoom.collections[-1].get_paths()[0].vertices
    inside = kubegpu_band[(kubegpu_band[:, 0] >= 110) & (kubegpu_band[:, 0] <= 120)]
    assert np.isclose(inside[:, 1].min(), 3.9) and np.isclose(inside[:, 1].max(), 4.3)


def test_plot_study_writes_a_png(tmp_path: Any) -> None:
    out = plot_study(study(2), tmp_path / "f.png", "two seeds")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_labels_give_the_value_at_the_headline_arrival_point() -> None:
    """The table headlines arrived 100 %; a curve that keeps stranding more up to 130 % is labelled with its
    value at 100 %, not at its end."""
    arrived = np.linspace(0, 130, 400)
    rising = {"fgd": 4.0, "random": 11.0}  # unallocated at 100 %; +0.1 per arrived % beyond
    results = {name: PolicySummary(name, name, [ReplayResult(
        name, name, 42, len(arrived), arrived,
        np.minimum(arrived, 100 - p - 0.1 * np.clip(arrived - 100, 0, None)), {}, {}, 0.0)])
        for name, p in rising.items()}
    zoom = build_figure(results, "").axes[1]
    labels = sorted(t.get_text() for t in zoom.texts)
    assert labels == ["fgd 4.0 % @100", "random 11.0 % @100"]
