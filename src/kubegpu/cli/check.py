"""``kubegpu check``: the admission rules, offline, on the manifests people are about to apply.

Runs :func:`kubegpu.model.normalise.review_pod` (the webhook's own function) on
every pod template of every file, so a manifest that passes here passes the
webhook with the same normalised requests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app
from kubegpu.cli.output import output_format, print_data
from kubegpu.model.manifests import ManifestError, Skipped, load_documents, pods_in_text
from kubegpu.model.names import review_names
from kubegpu.model.normalise import AdmissionPolicy, PodReview, request_summary, review_pod
from kubegpu.model.quantity import format_bytes
from kubegpu.model.resources import declared_gpu_resources, is_gpu_resource
from kubegpu.node.dra.claims import claim_objects

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read: {exc}") from None


def _object_json(file: str, src: Any, review: PodReview, policy: AdmissionPolicy) -> dict[str, Any]:
    # A refused GPU container has no parsed request, so the review alone would call the pod "no GPU".
    gpu = review.gpu_pod or any(is_gpu_resource(r.resource, policy.replica_resources) for r in review.refusals)
    return {
        "file": file,
        "document": src.document,
        "kind": src.kind,
        "name": src.name,
        "namespace": src.namespace,
        "path": src.path,
        "allowed": review.allowed,
        "gpu": gpu,
        "containers": request_summary(review.request),
        "refusals": [{"container": r.container, "resource": r.resource, "value": r.value,
                      "rule": r.rule, "code": r.code, "message": str(r)} for r in review.refusals],
        "patch": list(review.patch),
        "warnings": list(review.warnings),
        "changes": describe_patch(src.pod, review.patch),
    }


def _file_json(file: str, pod_specs: int, skipped: list[Skipped]) -> dict[str, Any]:
    """What was found in one file, so files without any pod spec are named too."""
    note = ""
    if not pod_specs:
        kinds = ", ".join(f"{s.kind} {s.name}".strip() for s in skipped)
        note = f"no pod specs found (only {kinds})" if skipped else "no pod specs found (the file is empty)"
    return {"file": file, "pod_specs": pod_specs,
            "skipped": [{"document": s.document, "kind": s.kind, "name": s.name} for s in skipped],
            "note": note}


def describe_patch(pod: Any, ops: Any) -> list[str]:
    """What the webhook would add besides the canonical resources, in words."""
    out = []
    spec: Any = pod.get("spec") if isinstance(pod, dict) else {}
    for op in ops:
        parts = op["path"].split("/")
        if parts[2] == "tolerations":
            value = op["value"] if isinstance(op["value"], dict) else op["value"][0]
            out.append(f"toleration {value['key']}:{value['effect']} added")
        elif len(parts) > 4 and parts[4] == "env":
            container = spec[parts[2]][int(parts[3])]
            out.append(f"container {container.get('name', parts[3])!r}: NVIDIA_VISIBLE_DEVICES=void added "
                       "(it asks for no GPU)")
    return out


def _per_gpu(c: dict[str, Any]) -> tuple[str, str]:
    if c["kind"] in ("whole",):
        return "100", "all"
    if c["kind"] != "share":
        return "-", "-"
    mem = "-"
    if c["memory_bytes_per_gpu"] is not None:
        mem = format_bytes(c["memory_bytes_per_gpu"])
    elif c["memory_ratio_per_gpu"] is not None:
        mem = f"{c['memory_ratio_per_gpu']} %"
    return str(c["core_per_gpu"]), mem


def _print_object(console: Console, obj: dict[str, Any], *, wide: bool = False,
                  flagged: list[str] | None = None) -> None:
    label = f"{obj['kind']} {obj['namespace'] + '/' if obj['namespace'] else ''}{obj['name'] or '(unnamed)'}"
    where = f"{obj['file']}#{obj['document']}" + (f" {obj['path']}" if obj["path"] else "")
    if not obj["allowed"]:
        console.print(f"[bold red]REFUSED[/] {label} [dim]{where}[/]")
        for r in obj["refusals"]:
            console.print(f"  [red]✗[/] {escape(r['message'])}")
        return
    if obj.get("dra"):
        console.print(f"[green]OK[/] {label} [dim]{where}[/]: DRA {escape(obj['dra'])}")
        return
    if not obj["containers"]:
        console.print(f"[green]OK[/] {label} [dim]{where}[/]: no GPU request")
        return
    wide_cols = ("resource", "init") if wide else ()
    table = Table(title=f"[green]OK[/] {label} [dim]{where}[/]", title_justify="left")
    for col in ("container", "kind", "count", "core/GPU", "memory/GPU", "canonical resources", *wide_cols):
        table.add_column(col)
    for c in obj["containers"]:
        core, mem = _per_gpu(c)
        name = c["container"] + (" (init)" if c["init"] else "")
        kind = c["kind"] + (f" {c['mig_profile']}" if c["mig_profile"] else "")
        canon = "\n".join(f"{k}: {v}" for k, v in c["canonical"].items())
        extra = (c["resource"], "yes" if c["init"] else "no") if wide else ()
        table.add_row(name, kind, str(c["count"]), core, mem, canon, *extra)
    console.print(table)
    if wide:
        for op in obj["patch"]:
            console.print(f"  [cyan]patch[/] {escape(json.dumps(op, sort_keys=True))}", highlight=False)
    for w in obj["warnings"]:
        console.print(f"  [yellow]{'!' if w in (flagged or ()) else '~'}[/] {escape(w)}")
    for change in obj["changes"]:
        console.print(f"  [cyan]+[/] {escape(change)}")


def _expand(paths: list[str]) -> tuple[list[str], list[dict[str, str]]]:
    """Files named, and the manifest files under each directory named (recursively, sorted)."""
    out: list[str] = []
    errors: list[dict[str, str]] = []
    for p in paths:
        path = Path(p)
        if p != "-" and path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.suffix in MANIFEST_SUFFIXES and f.is_file())
            if not found:
                errors.append({"file": p, "error": f"no {'/'.join(MANIFEST_SUFFIXES)} files in this directory"})
            out += found
        else:
            out.append(p)
    return out, errors


def _summary(objects: list[dict[str, Any]], files: int, errors: int) -> dict[str, int]:
    refused = sum(1 for o in objects if not o["allowed"])
    warned = sum(1 for o in objects if o.get("warned"))
    return {"files": files, "pod_specs": len(objects), "ok": len(objects) - refused - warned,
            "refused": refused, "warned": warned, "errors": errors}


def summary_line(s: dict[str, int]) -> str:
    """``12 pod specs in 3 files: 9 OK, 2 refused, 1 warned`` (and the unreadable files)."""
    line = (f"{s['pod_specs']} pod spec{'s' * (s['pod_specs'] != 1)} in {s['files']} "
            f"file{'s' * (s['files'] != 1)}: {s['ok']} OK, {s['refused']} refused, {s['warned']} warned")
    return line + (f", {s['errors']} unreadable" if s["errors"] else "")


def _notes(review: PodReview, notes: list[str]) -> list[str]:
    """The ``!`` lines of one pod, each once. A refused pod keeps only what would refuse it too: the
    scheduler-name advice is moot for a pod that is never admitted."""
    if not review.allowed:
        notes = [n for n in notes if n.startswith("refused by the webhook")]
    return list(dict.fromkeys(notes))


@app.command("check", short_help="Validate GPU requests in manifests with the webhook's rules.")
def check(
    files: list[str] = typer.Argument(
        ..., metavar="PATH...", show_default=False,
        help="Manifest files (YAML or JSON, multi-document) or directories (every *.yaml, *.yml and *.json "
             "below them); '-' reads stdin."),
    output: str = typer.Option("", "--output", "-o", metavar="FORMAT",
                               help="json, yaml or wide (also the JSON patch the webhook would apply); "
                                    "default: tables."),
    as_json: bool = typer.Option(False, "--json", help="Same as -o json."),
    replica_resource: list[str] = typer.Option(
        [], "--replica-resource", metavar="NAME",
        help="A renamed GPU resource the nodes serve (e.g. nvidia.com/small); repeatable."),
    toleration: bool = typer.Option(
        True, "--toleration/--no-toleration",
        help="Expect the GPU-taint toleration on GPU pods (as the webhook adds)."),
    void_env: bool = typer.Option(True, "--void-env/--no-void-env",
                                  help="Expect NVIDIA_VISIBLE_DEVICES=void on containers without GPUs."),
    values: Path | None = typer.Option(
        None, "--values", "-f", metavar="FILE",
        help="The install's values file: the resource names its nodes serve (renames, MIG profiles) are "
             "GPU resources, as they are to the webhook."),
    scheduler_name: str = typer.Option("kubegpu-scheduler", "--scheduler-name", metavar="NAME",
                                       help="kubegpu's scheduler profile: GPU pods without it get a warning "
                                            "('' for node-only mode)."),
) -> None:
    """Validate GPU requests in Pod and workload manifests (Deployment, StatefulSet, DaemonSet,
    ReplicaSet, Job, CronJob, Lists, custom resources with pod templates), with the webhook's rules.

    Refuses GPU resource names no node serves (with the name meant, where one is close) and GPU requests
    Kubernetes would not read. Prints the normalised requests or the refusals, then one summary line.
    Exit 0: all accepted; 1: something refused; 2: a file could not be read or is not YAML.
    """
    fmt = output_format(output or ("json" if as_json else ""), ("json", "yaml", "wide"))
    declared: tuple[str, ...] = ()
    if values is not None:
        from kubegpu.install.values import ValuesError, gpu_resources, load_values
        from kubegpu.model.resources import mig_resources

        try:
            loaded = load_values(values)
            declared = (*gpu_resources(loaded), *mig_resources(loaded.mig_profiles))
        except ValuesError as exc:
            make_console(stderr=True).print(f"[bold red]error[/] {escape(str(values))}: {escape(str(exc))}")
            raise typer.Exit(EXIT_BAD_INPUT) from None
    from kubegpu.webhook.app import WebhookSettings, offline_warnings

    policy = AdmissionPolicy(add_toleration=toleration, void_env=void_env,
                             replica_resources=frozenset(replica_resource) | frozenset(declared)
                             | declared_gpu_resources(os.environ))
    settings = WebhookSettings(policy=policy, scheduler_name=scheduler_name)
    console = make_console()
    objects: list[dict[str, Any]] = []
    paths, errors = _expand(files)
    found: list[dict[str, Any]] = []
    flags: dict[int, list[str]] = {}
    for file in paths:
        name = file if file != "-" else "<stdin>"
        try:
            text = _read(file)
            sources, skipped = pods_in_text(text)
        except ManifestError as exc:
            errors.append({"file": name, "error": str(exc)})
            continue
        found.append(_file_json(name, len(sources), skipped))
        for src in sources:
            review = review_pod(src.pod, policy)
            obj = _object_json(name, src, review, policy)
            # The names rule's warnings are said once, as notes, beside what the deployed webhook adds
            # (scheduler name, cap, records, envFrom).
            # The deployed webhook's own advice (scheduler name, cap, records, envFrom) is said once, as notes;
            # a pod is "warned" by those or by the names rule's warnings (already among the review's warnings,
            # as the webhook returns them, and printed as "!" lines).
            obj["notes"] = _notes(review, offline_warnings(src.pod, settings))
            flagged = [w for w in review_names(src.pod, policy.replica_resources)[1] if w in obj["warnings"]]
            obj["warned"] = obj["allowed"] and bool(obj["notes"] or flagged)
            objects.append(obj)
            flags[id(obj)] = flagged
        objects += claim_objects(name, load_documents(text))  # DRA claims/templates naming kubegpu's classes
    refused = any(not o["allowed"] for o in objects)
    code = EXIT_BAD_INPUT if errors else EXIT_REFUSED if refused else EXIT_OK
    summary = _summary(objects, len(found) + len(errors), len(errors))
    if fmt in ("json", "yaml"):
        report = {"ok": code == EXIT_OK, "objects": objects, "errors": errors, "files": found, "summary": summary}
        print_data(report, fmt)
    else:
        for o in objects:
            _print_object(console, o, wide=fmt == "wide", flagged=flags.get(id(o), []))
            for note in o.get("notes", ()):
                console.print(f"  [yellow]![/] {escape(note)}", highlight=False)
        for f in found:
            if f["note"]:
                console.print(f"[yellow]note[/] {escape(f['file'])}: {escape(f['note'])}")
        for e in errors:
            make_console(stderr=True).print(f"[bold red]error[/] {escape(e['file'])}: {escape(e['error'])}")
        colour = "red" if refused or errors else "yellow" if summary["warned"] else "green"
        console.print(f"[{colour}]{escape(summary_line(summary))}[/]", highlight=False)
    raise typer.Exit(code)
