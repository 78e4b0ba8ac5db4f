"""Finding pod templates in manifests; YAML errors with their position."""

from __future__ import annotations

import pytest

from kubegpu.model.manifests import ManifestError, load_documents, pods_in, pods_in_text

POD_SPEC = {"containers": [{"name": "c", "image": "x"}]}


def test_pod_is_itself() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}, "spec": POD_SPEC}
    (src,), skipped = pods_in(pod)
    assert skipped == [] and src.pod is pod and src.label == "Pod n/p"


def test_template_namespace_and_labels_carried_over() -> None:
    dep = {"kind": "Deployment", "metadata": {"name": "d", "namespace": "ml"},
           "spec": {"template": {"metadata": {"labels": {"a": "b"}, "annotations": {"k": "v"}}, "spec": POD_SPEC}}}
    (src,), _ = pods_in(dep)
    assert src.pod["metadata"] == {"labels": {"a": "b"}, "annotations": {"k": "v"}, "namespace": "ml"}
    assert src.pod["spec"] is dep["spec"]["template"]["spec"]
    assert src.label == "Deployment ml/d (spec.template)"


def test_cronjob_and_podtemplate_paths() -> None:
    cron = {"kind": "CronJob", "metadata": {"name": "c"},
            "spec": {"jobTemplate": {"spec": {"template": {"spec": POD_SPEC}}}}}
    assert pods_in(cron)[0][0].path == "spec.jobTemplate.spec.template"
    tmpl = {"kind": "PodTemplate", "metadata": {"name": "t"}, "template": {"spec": POD_SPEC}}
    assert pods_in(tmpl)[0][0].path == "template"


def test_workload_without_template_and_unrelated_kinds_are_skipped() -> None:
    found, skipped = pods_in({"kind": "Deployment", "metadata": {"name": "d"}, "spec": {}})
    assert found == [] and [(s.kind, s.name) for s in skipped] == [("Deployment", "d")]
    found, skipped = pods_in({"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"template": "x"}})
    assert found == [] and skipped[0].kind == "ConfigMap"


def test_custom_resources_with_templates_in_lists() -> None:
    obj = {"kind": "JobSet", "metadata": {"name": "js"}, "spec": {"replicatedJobs": [
        {"name": "a", "template": {"spec": {"template": {"spec": POD_SPEC}}}},
        {"name": "b", "template": {"spec": {"template": {"spec": POD_SPEC}}}}]}}
    found, _ = pods_in(obj)
    assert [f.path for f in found] == ["spec.replicatedJobs[0].template.spec.template",
                                      "spec.replicatedJobs[1].template.spec.template"]


def test_multi_document_text_with_empty_documents() -> None:
    text = "---\nkind: Pod\nmetadata: {name: a}\nspec: {containers: []}\n---\n---\nkind: Service\n"
    found, skipped = pods_in_text(text)
    assert [f.name for f in found] == ["a"] and [s.kind for s in skipped] == ["Service"]
    assert found[0].document == 0 and skipped[0].document == 1


@pytest.mark.parametrize(("text", "line"), [("a: [\n", 2), ("a: 1\nb: [1,\n  c: d: e\n", 3), ("x: 'open\n", 2)])
def test_yaml_errors_say_where(text: str, line: int) -> None:
    with pytest.raises(ManifestError, match=f"line {line}"):
        load_documents(text)


@pytest.mark.parametrize("text", ["[" * 100_000, "- " * 100_000 + "a", "{a: " * 50_000])
def test_deep_nesting_is_an_error_not_a_crash(text: str) -> None:
    """libyaml's C composer has no recursion guard: without the depth check this is a segfault."""
    from kubegpu.model.manifests import ManifestError, load_documents

    with pytest.raises(ManifestError, match="nested deeper"):
        load_documents(text)
