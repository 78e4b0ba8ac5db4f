"""Which build runs: the version, and the commit and date it was built from (``kubegpu --version``).

The package version alone (``0.1.0``) cannot tell two builds apart. In a git checkout (the README's
editable install) the commit comes from git itself; an image has no ``.git``, so the Dockerfile bakes
the commit and the build date into ``kubegpu/cli/_build_info.py`` (``COMMIT`` and ``DATE``; not in git).
Neither available (a wheel built without the metadata) is said as such, never guessed.
"""

from __future__ import annotations

import importlib
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The checkout is the one this very file lives in: never the current directory, which may be another repo.
_HERE = Path(__file__).resolve()


@dataclass(frozen=True, slots=True)
class BuildInfo:
    version: str
    commit: str  # full hash, or "" when unknown
    date: str  # ISO 8601: the commit's date in a checkout, the build's date in an image; "" when unknown
    source: str  # "git", "build metadata" or ""
    modified: bool = False  # a checkout with uncommitted changes

    def __str__(self) -> str:
        if not self.commit:
            return f"kubegpu {self.version} (commit unknown: not a git checkout and no build metadata)"
        dirty = ", with uncommitted changes" if self.modified else ""
        return f"kubegpu {self.version} (commit {self.commit[:12]}, {self.date or 'date unknown'}{dirty}; " \
               f"from {self.source})"


def _version() -> str:
    try:
        return version("kubegpu")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "(version unknown: not installed)"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5,
                              check=False)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _checkout() -> Path | None:
    for parent in _HERE.parents:
        if (parent / ".git").exists():  # a directory, or a file in a worktree
            return parent
    return None


def build_info() -> BuildInfo:
    """Git first (a checkout is newer than any metadata baked into it), then the baked metadata."""
    root = _checkout()
    if root is not None:
        head = _git(root, "log", "-1", "--format=%H %cI")
        if head and " " in head:
            commit, date = head.split(" ", 1)
            status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", "src")
            return BuildInfo(_version(), commit, date, "git", bool(status))
    try:
        baked = importlib.import_module("kubegpu.cli._build_info")
    except ImportError:
        return BuildInfo(_version(), "", "", "")
    commit, date = str(getattr(baked, "COMMIT", "")), str(getattr(baked, "DATE", ""))
    if commit in ("", "unknown"):
        return BuildInfo(_version(), "", "", "")
    return BuildInfo(_version(), commit, date, "build metadata")
