"""Only the roles' entry points read the process environment; everything below them is handed what it needs.

A module that reads ``os.environ`` itself behaves differently in a test, a stand-in and a real pod, and hides an
input a reader of its signature cannot see (the record key, the declared GPU resource names, the MPS daemon's
environment). So each role's entry (``kubegpu.cli``) reads its environment once and passes it down; ``install``
renders it and the demo starts processes with it. This test walks the source tree's syntax and fails on any
other reference to ``os.environ``, ``os.getenv`` or ``os.putenv`` (also through ``from os import ...``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kubegpu

ROOT = Path(kubegpu.__file__).resolve().parent
# Where reading the process environment is the job: the role entries, the manifests, the demo's processes.
ALLOWED = ("cli", "demo", "install")
NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


def environment_reads(tree: ast.AST) -> list[int]:
    """Line numbers of every use of ``os.environ`` (and its kin) in a module's syntax tree."""
    aliases = {"os"}  # names the module os is bound to
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in NAMES]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in NAMES and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_every_form() -> None:
    source = ("import os\nimport os as o\nfrom os import getenv\n"
              "a = os.environ['A']\nb = o.getenv('B')\nc = os.path.join('x')\n")
    assert environment_reads(ast.parse(source)) == [3, 4, 5]


def test_no_module_below_the_entries_reads_the_environment() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ALLOWED:
            continue
        found += [f"{rel}:{line}" for line in environment_reads(ast.parse(path.read_text(), str(path)))]
    assert found == [], "read the environment at the role's entry (kubegpu/cli) and pass it in: " + ", ".join(found)
