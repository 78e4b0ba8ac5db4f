"""Every command's ``--help`` reads well at 80 columns: whole option names, flags shown as flags, a
description on every option, and ``kubegpu --version``."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from kubegpu.cli.main import app

runner = CliRunner()
COMMANDS = ["check", "simulate", "node", "scheduler", "webhook", "webhook-certs", "status", "manifests", "demo"]
DESCRIBED = COMMANDS


def help_text(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def option_rows(text: str) -> list[tuple[str, str]]:
    """(option names, description) per option in the Options section (click) or in every group of options
    (argparse, ``kubegpu node``), descriptions joined over lines."""
    rows: list[tuple[str, str]] = []
    if "\nOptions:\n" in text:
        section = text.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]  # up to the epilog, if any
    else:
        section = text.split("\noptions:\n", 1)[1]
    for line in section.splitlines():
        if re.match(r"^  -", line):
            names, _, desc = line.strip().partition("  ")
            rows.append((names, desc.strip()))
        elif line.startswith("    ") and rows:  # a description's next line, or all of it after a long name
            names, desc = rows[-1]
            rows[-1] = (names, (desc + " " + line.strip()).strip())
    return rows


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_80_columns_and_cuts_nothing(command: str) -> None:
    text = help_text(*([command] if command else []))
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text and not re.search(r"<(bool|str|int|float|path)>", text), text
    assert "\\[" not in text, text  # plain click help: no escaped rich markup


@pytest.mark.parametrize("command", DESCRIBED)
def test_every_option_has_a_description(command: str) -> None:
    rows = option_rows(help_text(command))
    assert rows
    for names, desc in rows:
        assert desc and not desc.startswith("["), (command, names, desc)


def test_flags_are_shown_as_flags() -> None:
    rows = dict(option_rows(help_text("check")))
    assert "--json" in rows and "--toleration / --no-toleration" in rows
    assert "--replica-resource NAME" in rows


def test_version_names_the_commit_from_git_in_a_checkout() -> None:
    from kubegpu.cli import buildinfo

    root = buildinfo._checkout()
    assert root is not None, "the tests run from a git checkout"
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith(f"kubegpu {version('kubegpu')} (commit {head[:12]}, 20"), result.output
    assert result.output.rstrip().endswith("from git)")


def test_version_from_build_metadata_or_says_it_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """An image: no .git, the commit and date the Dockerfile baked in; neither: said, not guessed."""
    from kubegpu.cli import buildinfo

    monkeypatch.setattr(buildinfo, "_checkout", lambda: None)
    baked = types.ModuleType("kubegpu.cli._build_info")
    baked.COMMIT, baked.DATE = "0123456789abcdef0123", "2026-11-26T05:00:00Z"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kubegpu.cli._build_info", baked)
    out = runner.invoke(app, ["--version"]).output.strip()
    assert out == f"kubegpu {version('kubegpu')} (commit 0123456789ab, 2026-11-26T05:00:00Z; from build metadata)"
    monkeypatch.setitem(sys.modules, "kubegpu.cli._build_info", None)  # import fails
    out = runner.invoke(app, ["--version"]).output.strip()
    assert out == f"kubegpu {version('kubegpu')} (commit unknown: not a git checkout and no build metadata)"
