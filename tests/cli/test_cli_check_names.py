"""``kubegpu check`` on names no node serves, on directories, with a summary line and ``-o yaml|wide``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.check import summary_line
from kubegpu.cli.main import app
from kubegpu.model.names import review_names, suggest

runner = CliRunner()


def pod(name: str, container: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "cuda", **container}]}}


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["check", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(("container", "code", "meant"), [
    ({"resources": {"limits": {"nvidia.com/gpus": 1}}}, "unknown-resource", "nvidia.com/gpu"),
    ({"resources": {"limits": {"nvidia.com/gpu-shared": 1}}}, "unknown-resource", "nvidia.com/gpu.shared"),
    ({"resources": {"limits": {"kubegpu.io/gpu-memroy": "8Gi"}}}, "unknown-resource", "kubegpu.io/gpu-memory"),
    ({"resources": {"limits": {"nvidia.com/mig-1g.11gb": 1}}}, "unknown-mig-profile", "nvidia.com/mig-1g.10gb"),
    ({"resource": {"limits": {"nvidia.com/gpu": 1}}}, "unreadable-request", "'resources'"),
    ({"resources": {"limit": {"nvidia.com/gpu": 1}}}, "unreadable-request", "'limits'"),
    ({"resources": {"nvidia.com/gpu": 1}}, "unreadable-request", "resources.limits.nvidia.com/gpu"),
])
def test_names_no_node_serves_are_refused_with_the_name_meant(tmp_path: Path, container: dict[str, Any],
                                                              code: str, meant: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pod("p", container)))
    rc, out = run(str(path), "-o", "json")
    assert rc == 1, out
    (obj,) = json.loads(out)["objects"]
    assert [r["code"] for r in obj["refusals"]] == [code]
    assert meant in obj["refusals"][0]["message"]


def test_an_undeclared_rename_is_warned_and_a_declared_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pod("p", {"resources": {"limits": {"nvidia.com/sharedgpu": 1}}})))
    rc, out = run(str(path), "--scheduler-name", "")
    assert rc == 0, out
    assert "! container 'c': nvidia.com/sharedgpu is not a resource kubegpu serves by default" in out
    assert out.splitlines()[-1] == "1 pod spec in 1 file: 0 OK, 0 refused, 1 warned"
    rc, out = run(str(path), "--scheduler-name", "", "--replica-resource", "nvidia.com/sharedgpu")
    assert rc == 0 and "serves by default" not in out
    assert out.splitlines()[-1] == "1 pod spec in 1 file: 1 OK, 0 refused, 0 warned"


def test_directories_are_read_recursively_and_end_with_a_summary(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "ok.yaml").write_text(yaml.safe_dump(pod("ok", {"resources": {"limits": {"nvidia.com/gpu": 1}}})))
    (tmp_path / "a" / "b" / "bad.yml").write_text(
        yaml.safe_dump(pod("bad", {"resources": {"limits": {"nvidia.com/gpus": 1}}})))
    (tmp_path / "a" / "b" / "plain.json").write_text(json.dumps(pod("plain", {})))
    (tmp_path / "a" / "notes.txt").write_text("not a manifest")
    rc, out = run(str(tmp_path / "a"))
    assert rc == 1, out
    lines = out.splitlines()
    assert lines[-1] == "3 pod specs in 3 files: 1 OK, 1 refused, 1 warned"
    # The refused pod is not also told to set its scheduler name; the accepted GPU pod is, once.
    refused_at = next(i for i, line in enumerate(lines) if line.startswith("REFUSED Pod bad"))
    assert not lines[refused_at + 2].startswith("  !")
    assert sum("spec.schedulerName is not set" in line for line in lines) == 1


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    rc, out = run(str(tmp_path))
    assert rc == 2 and "no .yaml/.yml/.json files in this directory" in out


def test_yaml_and_json_output_say_the_same(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump_all([pod("a", {"resources": {"limits": {"nvidia.com/gpu": 1}}}),
                                        pod("b", {"resources": {"limits": {"nvidia.com/gpus": 1}}})]))
    rc_json, as_json = run(str(path), "-o", "json")
    rc_yaml, as_yaml = run(str(path), "-o", "yaml")
    assert rc_json == rc_yaml == 1
    assert yaml.safe_load(as_yaml) == json.loads(as_json)


def test_a_3000_document_file_ends_with_its_count(tmp_path: Path) -> None:
    doc = ("apiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}}}\nspec:\n  containers:\n  - name: c\n"
           "    image: cuda\n    resources: {{limits: {{{name}: 1}}}}\n")
    path = tmp_path / "many.yaml"
    path.write_text("---\n".join(doc.format(i=i, name="nvidia.com/gpus" if i % 1000 == 0 else "nvidia.com/gpu")
                                 for i in range(3000)))
    rc, out = run(str(path), "--scheduler-name", "", "-o", "json")  # the tables' own summary line: above
    assert rc == 1
    report = json.loads(out)
    assert report["summary"] == {"files": 1, "pod_specs": 3000, "ok": 2997, "refused": 3, "warned": 0, "errors": 0}
    assert summary_line(report["summary"]) == "3000 pod specs in 1 file: 2997 OK, 3 refused, 0 warned"


def test_wide_shows_the_patch_and_unknown_formats_are_usage_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pod("p", {"resources": {"limits": {"nvidia.com/gpu": 1}}})))
    rc, out = run(str(path), "-o", "wide")
    assert rc == 0 and '  patch {"op": "add", "path": "/spec/tolerations"' in out
    rc, out = run(str(path), "-o", "xml")
    assert rc == 2 and "use one of json, yaml, wide" in out


def test_the_rule_is_pure_and_knows_declared_names() -> None:
    p = pod("p", {"resources": {"limits": {"nvidia.com/gpus": 1}}})
    refusals, _ = review_names(p)
    assert [r.code for r in refusals] == ["unknown-resource"]
    assert review_names(p, declared=["nvidia.com/gpus"]) == ([], [])
    assert suggest("nvidia.com/mig-3g.41gb") == "nvidia.com/mig-3g.40gb"
    assert suggest("nvidia.com/sharedgpu") is None
