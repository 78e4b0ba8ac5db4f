"""``kubegpu demo --dra`` runs the DRA path end to end and every check passes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kubegpu.cli.main import app


def test_demo_dra_passes() -> None:
    r = CliRunner().invoke(app, ["demo", "--dra", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["mode"] == "dra"
    assert len(summary["checks"]) == 9 and all(c["ok"] for c in summary["checks"])
    assert summary["prepares"] >= 6
