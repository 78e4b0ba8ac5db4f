"""``kubegpu check``: pod templates found in every workload kind, tables and JSON, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app

# The seed examples, shipped with the tests (copied from the project's shared seed-examples).
SEEDS = Path(__file__).resolve().parents[1] / "fixtures" / "seed-examples"

runner = CliRunner()

GPU = {"name": "train", "image": "cuda", "resources": {"limits": {"alpha.kubernetes.io/nvidia-gpu": 2}}}
SHARE = {"name": "infer", "image": "cuda", "resources": {"requests": {"kubernetes.io/gpu": "50"}}}
BAD = {"name": "broken", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}


def template(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": list(containers)}}


def workload(kind: str, name: str, *containers: dict[str, Any]) -> dict[str, Any]:
    api = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "DaemonSet": "apps/v1", "ReplicaSet": "apps/v1",
           "Job": "batch/v1", "CronJob": "batch/v1"}[kind]
    meta = {"name": name, "namespace": "ml"}
    if kind == "CronJob":
        return {"apiVersion": api, "kind": kind, "metadata": meta,
                "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template(*containers)}}}}
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": {"template": template(*containers)}}


def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = runner.invoke(app, ["check", *args], input=stdin)
    return result.exit_code, result.output


def write(tmp_path: Path, docs: list[Any], name: str = "m.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_every_workload_kind_in_one_multi_doc_file(tmp_path: Path) -> None:
    docs = [workload(k, k.lower(), GPU) for k in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet",
                                                  "Job", "CronJob")]
    docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [SHARE]}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"}, "spec": {"ports": []}})
    docs.append({"apiVersion": "v1", "kind": "List", "items": [workload("Job", "listed", SHARE)]})
    docs.append({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "ddp"},
                 "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": template(GPU)},
                                                  "Worker": {"replicas": 3, "template": template(SHARE)}}}})
    code, out = run(write(tmp_path, docs), "--json")
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] is True
    found = [(o["kind"], o["name"], o["path"]) for o in report["objects"]]
    assert found == [
        ("Deployment", "deployment", "spec.template"), ("StatefulSet", "statefulset", "spec.template"),
        ("DaemonSet", "daemonset", "spec.template"), ("ReplicaSet", "replicaset", "spec.template"),
        ("Job", "job", "spec.template"), ("CronJob", "cronjob", "spec.jobTemplate.spec.template"),
        ("Pod", "p", ""), ("Job", "listed", "spec.template"),
        ("PyTorchJob", "ddp", "spec.pytorchReplicaSpecs.Master.template"),
        ("PyTorchJob", "ddp", "spec.pytorchReplicaSpecs.Worker.template"),
    ]
    deployment = report["objects"][0]
    assert deployment["namespace"] == "ml"
    (c,) = deployment["containers"]
    assert (c["container"], c["kind"], c["count"], c["canonical"]) == ("train", "whole", 2, {"nvidia.com/gpu": "2"})
    pod = report["objects"][6]
    assert pod["containers"][0]["canonical"] == {"kubegpu.io/gpu-core": "50", "kubegpu.io/gpu-memory-ratio": "50",
                                                 "kubegpu.io/gpu.shared": "1"}
    assert pod["containers"][0]["core_per_gpu"] == 50 and pod["containers"][0]["memory_ratio_per_gpu"] == 50


def test_table_output_shows_the_normalised_request(tmp_path: Path) -> None:
    code, out = run(write(tmp_path, [workload("Deployment", "web", GPU, {"name": "side", "image": "x"})]))
    assert code == 0
    assert "OK" in out and "Deployment ml/web" in out
    assert "train" in out and "whole" in out and "nvidia.com/gpu: 2" in out
    assert "alpha.kubernetes.io/nvidia-gpu" in out  # the warning says what was renamed
    flat = " ".join(out.split())
    assert "container 'side': NVIDIA_VISIBLE_DEVICES=void added" in flat
    assert "toleration nvidia.com/gpu:NoSchedule added" in flat


def test_refusals_exit_1_and_name_container_resource_value_rule(tmp_path: Path) -> None:
    path = write(tmp_path, [workload("Job", "ok", GPU), workload("Deployment", "bad", BAD)])
    code, out = run(path)
    assert code == 1
    assert "REFUSED" in out and "Deployment ml/bad" in out
    flat = " ".join(out.split())
    assert "container 'broken': nvidia.com/gpu='0.5'" in flat
    assert "[whole-number]" in flat  # the rule's code survives the terminal markup
    code, out = run(path, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert [o["allowed"] for o in report["objects"]] == [True, False]
    (r,) = report["objects"][1]["refusals"]
    assert (r["container"], r["resource"], r["value"], r["code"]) == ("broken", "nvidia.com/gpu", "0.5",
                                                                      "whole-number")


def test_stdin(tmp_path: Path) -> None:
    code, out = run("-", "--json", stdin=yaml.safe_dump(workload("Job", "j", SHARE)))
    assert code == 0
    assert json.loads(out)["objects"][0]["file"] == "<stdin>"


@pytest.mark.parametrize("text", ["a: [\n", "key: {unclosed", "\t- tab", "- a\nb: c"])
def test_bad_yaml_exits_2_with_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out = run(str(path))
    assert code == 2
    assert "not valid YAML" in out and "line" in out


def test_missing_file_exits_2(tmp_path: Path) -> None:
    code, out = run(str(tmp_path / "nope.yaml"), "--json")
    assert code == 2
    report = json.loads(out)
    assert report["errors"][0]["file"].endswith("nope.yaml") and "cannot read" in report["errors"][0]["error"]


def test_bad_file_among_good_ones_still_reports_the_good_ones(tmp_path: Path) -> None:
    good = write(tmp_path, [workload("Job", "j", GPU)], "good.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [")
    code, out = run(good, str(bad), "--json")
    assert code == 2
    report = json.loads(out)
    assert len(report["objects"]) == 1 and len(report["errors"]) == 1


def test_json_documents_and_non_objects(tmp_path: Path) -> None:
    path = tmp_path / "pod.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j"},
                                "spec": {"containers": [GPU]}}))
    code, out = run(str(path), "--json")
    assert code == 0 and json.loads(out)["objects"][0]["name"] == "j"
    scalars = write(tmp_path, ["just a string", 42, [1, 2]], "scalars.yaml")
    code, out = run(scalars, "--json")
    assert code == 0 and json.loads(out)["objects"] == []


def test_declared_replica_resource(tmp_path: Path) -> None:
    c = {"name": "r", "image": "x", "resources": {"limits": {"nvidia.com/small": 1}}}
    path = write(tmp_path, [workload("Job", "j", c)])
    code, out = run(path, "--json", "--replica-resource", "nvidia.com/small")
    assert code == 0 and json.loads(out)["objects"][0]["containers"][0]["kind"] == "replica"
    code, out = run(path, "--json")
    assert code == 0 and json.loads(out)["objects"][0]["containers"] == []


def test_seed_examples_all_pass() -> None:
    seeds = sorted(str(p) for p in SEEDS.glob("*.yaml"))
    code, out = run(*seeds, "--json")
    assert code == 0
    report = json.loads(out)
    assert sum(1 for o in report["objects"] if o["kind"] == "Pod") == 8
    assert all(o["allowed"] for o in report["objects"])


def test_error_lines_are_never_wrapped_without_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No COLUMNS and no terminal (CI, a pipe, `kubectl logs`): one error is one line, however long."""
    monkeypatch.delenv("COLUMNS", raising=False)
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    deep.mkdir(parents=True)
    path = deep / "bad.yaml"
    path.write_text("a: [\n")
    code, out = run(str(path))
    assert code == 2
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error {path}: not valid YAML at line 2"), out
    assert lines[1] == "0 pod specs in 1 file: 0 OK, 0 refused, 0 warned, 1 unreadable"


def test_files_without_pod_specs_are_named_in_text_and_json(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    svc = write(tmp_path, [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}},
                           {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}}], "svc.yaml")
    pods = write(tmp_path, [workload("Job", "j", GPU)], "job.yaml")
    code, out = run(str(empty), svc, pods)
    assert code == 0
    lines = out.splitlines()
    assert f"note {empty}: no pod specs found (the file is empty)" in lines
    assert f"note {svc}: no pod specs found (only Service web, ConfigMap cfg)" in lines
    assert not any(line.startswith(f"note {pods}") for line in lines)
    code, out = run(str(empty), svc, pods, "--json")
    files = {f["file"]: f for f in json.loads(out)["files"]}
    assert files[str(empty)]["pod_specs"] == 0 and files[str(empty)]["skipped"] == []
    assert files[svc]["pod_specs"] == 0
    assert [(s["kind"], s["name"]) for s in files[svc]["skipped"]] == [("Service", "web"), ("ConfigMap", "cfg")]
    assert files[pods] == {"file": pods, "pod_specs": 1, "skipped": [], "note": ""}


def test_refused_gpu_workload_is_still_a_gpu_object(tmp_path: Path) -> None:
    path = write(tmp_path, [workload("CronJob", "nightly", BAD)])
    code, out = run(path, "--json")
    assert code == 1
    (obj,) = json.loads(out)["objects"]
    assert obj["kind"] == "CronJob" and obj["allowed"] is False and obj["gpu"] is True


def test_gpu_shorthand_with_shared_slots_is_refused(tmp_path: Path) -> None:
    """The protocol's allowed combinations have kubegpu.io/gpu alone; gpu.shared goes with a memory form."""
    c = {"name": "s", "image": "x", "resources": {"limits": {"kubegpu.io/gpu": "100", "kubegpu.io/gpu.shared": "2"}}}
    code, out = run(write(tmp_path, [workload("Job", "j", c)]), "--json")
    assert code == 1
    (r,) = json.loads(out)["objects"][0]["refusals"]
    assert (r["resource"], r["code"]) == ("kubegpu.io/gpu", "combination") and "gpu.shared" in r["rule"]


def test_manifests_are_parsed_with_libyaml_when_pyyaml_has_it() -> None:
    from kubegpu.model import manifests

    expected = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
    assert manifests._Loader is expected
    assert manifests.load_documents("a: 1\n---\n---\nb: [2]\n") == [{"a": 1}, {"b": [2]}]


@pytest.mark.parametrize("text", ["[" * 100_000, "- " * 5000 + "x", "{a: " * 5000, "[" * 300 + "]" * 300])
def test_deep_nesting_is_a_clear_error_not_a_crash(tmp_path: Path, text: str) -> None:
    """libyaml composes by C recursion: without the depth check these crash the process."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    code, out = run(str(path))
    assert code == 2 and "nested deeper than" in out, out


def test_nesting_a_manifest_uses_is_fine(tmp_path: Path) -> None:
    from kubegpu.model.manifests import MAX_YAML_DEPTH, load_documents

    deep: Any = "x"
    for _ in range(MAX_YAML_DEPTH - 1):
        deep = {"a": deep}
    assert load_documents(yaml.safe_dump(deep, width=10**6))[0]["a"]["a"]["a"]


def test_a_share_pod_given_to_another_scheduler_is_noted_as_refused_by_the_webhook(tmp_path: Path) -> None:
    job = workload("Job", "j", SHARE)
    job["spec"]["template"]["spec"]["schedulerName"] = "volcano"
    _, out = run(write(tmp_path, [job, workload("Job", "k", SHARE)]), "--json")
    first, second = json.loads(out)["objects"]
    assert any(n.startswith("refused by the webhook: GPU shares") and "'volcano'" in n for n in first["notes"])
    assert not any("neither places nor accounts" in n for n in first["notes"])  # said once, as the refusal
    assert not any("refused by the webhook" in n for n in second["notes"])
