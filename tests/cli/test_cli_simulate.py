"""``kubegpu simulate`` as a command: its table fits the width asked for, the paper's numbers only beside the
paper's trace, --plot's needs checked before the replay, and every policy in the help."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trace_slices import trace_slice as trace
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.placement.policies import POLICY_NAMES
from kubegpu.sim.trace import default_path


def simulate(*args: str, columns: str = "80") -> Any:
    return CliRunner().invoke(app, ["simulate", *args], env={"COLUMNS": columns})


@pytest.mark.parametrize("seeds", ["1", "3"])
def test_the_table_fits_80_columns_and_a_users_pod_list_has_no_paper_column(tmp_path: Path, seeds: str) -> None:
    n, p = trace(tmp_path)
    res = simulate("--nodes", str(n), "--pods", str(p), "-p", "fgd", "-p", "bestfit", "--seeds", seeds)
    assert res.exit_code == 0, res.output
    table = [line for line in res.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80, "\n".join(table)
    header = table[1]
    assert "100 %" in header and "policy" in header
    assert "paper @100" not in res.output  # the paper's numbers are for its own trace only
    assert "not shown at 80 columns:" in res.output
    wide = simulate("--nodes", str(n), "--pods", str(p), "-p", "fgd", "--seeds", seeds, columns="200")
    assert "not shown" not in wide.output and "95 %" in wide.output and "s/run" in wide.output


def test_the_paper_column_beside_the_papers_own_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The packaged lists copied elsewhere are still the paper's; replaying them all is not needed to say so.
    from kubegpu.cli import simulate as cli

    copy = tmp_path / "pods.csv"
    copy.write_bytes(default_path("openb_pod_list_default.csv").read_bytes())
    assert cli._is_packaged(copy, cli.PAPER_TRACE[1]) and cli._is_packaged(None, cli.PAPER_TRACE[0])
    copy.write_text(copy.read_text()[:-2] + "\n")
    assert not cli._is_packaged(copy, cli.PAPER_TRACE[1])


def test_plot_without_matplotlib_fails_before_the_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kubegpu.sim import study

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(study, "run_study", lambda *a, **k: pytest.fail("replayed before checking --plot"))
    n, p = trace(tmp_path)
    res = simulate("--nodes", str(n), "--pods", str(p), "--plot", str(tmp_path / "f.png"))
    assert res.exit_code == 2 and "--plot needs matplotlib" in res.output and "kubegpu[sim]" in res.output
    monkeypatch.setattr(importlib.util, "find_spec", real)
    res = simulate("--nodes", str(n), "--pods", str(p), "--plot", str(tmp_path / "nosuch" / "f.png"))
    assert res.exit_code == 2 and "does not exist" in res.output


def test_every_policy_is_in_the_help() -> None:
    from kubegpu.cli.simulate import POLICIES_IN_HELP

    assert POLICIES_IN_HELP == POLICY_NAMES
    text = " ".join(CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"}).output.split())
    for name in POLICY_NAMES:
        assert f" {name}," in text or f" {name} " in text, name


def test_output_json_is_json_and_other_formats_are_usage_errors(tmp_path: Path) -> None:
    n, p = trace(tmp_path, n_pods=50)
    res = simulate("--nodes", str(n), "--pods", str(p), "-p", "fgd", "-o", "json")
    assert res.exit_code == 0 and set(json.loads(res.output.splitlines()[-1])["policies"]) == {"fgd"}
    res = simulate("-o", "yaml")
    assert res.exit_code == 2 and "use one of json" in res.output
