"""``resource.k8s.io/v1`` validation as a v1.36 API server does it, with its exact messages.

The stand-in API server calls :func:`validate` on every ResourceSlice, DeviceClass and
ResourceClaim write; a non-empty list of causes is answered 422 ``Invalid``, with the message
the real server builds (``ResourceSlice.resource.k8s.io "x" is invalid: ...``).
:func:`kubectl_message` renders causes as ``kubectl`` prints them, which is what the
recordings hold (fixtures ``dra-v1.36/s9-validation``). Covered: attribute names and types,
versions (semver), capacity request policies, device and counter names, list limits
(128 devices, 8 counter sets, 2 consumed counter sets per device), duplicates, taint effects,
node selection, and ``sharedCounters`` xor ``devices``. Like the real server it accepts a device
consuming a counter set that no slice defines (checked only at allocation).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

from kubegpu.model.quantity import QuantityError, parse

_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                     r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
                     r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")

C_IDENT_MSG: Final = ("a valid C identifier must start with alphabetic character or '_', followed by a string of "
                      "alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for "
                      "validation is '[A-Za-z_][A-Za-z0-9_]*')")
DNS_LABEL_MSG: Final = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
                        "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
                        "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
SEMVER_MSG: Final = "must be a string compatible with semver.org spec 2.0.0"
MAX_DEVICES: Final = 128
MAX_COUNTER_SETS: Final = 8
MAX_CONSUMED_SETS: Final = 2
TAINT_EFFECTS: Final = ("NoExecute", "NoSchedule", "None")
_ATTR_FIELDS: Final = (("int", "IntValue"), ("bool", "BoolValue"), ("string", "StringValue"),
                       ("version", "VersionValue"), ("ints", "IntValues"), ("bools", "BoolValues"),
                       ("strings", "StringValues"), ("versions", "VersionValues"))

Cause = tuple[str, str]  # (field path, message after the path)


def _q(v: Any) -> str:
    return json.dumps(v)


def invalid(path: str, value: Any, msg: str) -> Cause:
    return (path, f"Invalid value: {_q(value)}: {msg}")


def _quantity(v: Any) -> Decimal | None:
    try:
        return parse(v)
    except (QuantityError, ValueError, TypeError):
        return None


def _attribute(path: str, name: str, value: Any) -> list[Cause]:
    out: list[Cause] = []
    if not isinstance(value, Mapping):
        return [invalid(f"{path}[{name}]", value, "must be an object")]
    set_fields = [k for k, _ in _ATTR_FIELDS if value.get(k) is not None]
    if len(set_fields) != 1:
        shown = "{" + ",".join(f"{_q(go)}:{_q(value.get(k))}" for k, go in _ATTR_FIELDS) + "}"
        return [(f"{path}[{name}]", f"Invalid value: {shown}: exactly one value must be specified")]
    if "version" in value and not _SEMVER.match(str(value["version"])):
        out.append(invalid(f"{path}[{name}].version", value["version"], SEMVER_MSG))
    if "string" in value and len(str(value["string"])) > 64:
        out.append((f"{path}[{name}].string", "Too long: may not be more than 64 bytes"))
    return out


def _attribute_name(path: str, name: str) -> list[Cause]:
    domain, sep, ident = name.rpartition("/")
    out: list[Cause] = []
    if sep and not _DNS_SUBDOMAIN.match(domain):
        out.append(invalid(path, domain, "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                         "characters, '-' or '.', and must start and end with an alphanumeric "
                                         "character"))
    if not _C_IDENT.match(ident) or len(ident) > 32:
        out.append(invalid(path, ident, C_IDENT_MSG))
    return out


def _capacity(path: str, name: str, cap: Any) -> list[Cause]:
    p = f"{path}[{name}]"
    if not isinstance(cap, Mapping) or _quantity(cap.get("value")) is None:
        return [(f"{p}.value", "Required value")]
    value = _quantity(cap["value"])
    assert value is not None
    policy = cap.get("requestPolicy")
    if not isinstance(policy, Mapping):
        return []
    out: list[Cause] = []
    rp = f"{p}.requestPolicy"
    default = _quantity(policy.get("default")) if policy.get("default") is not None else None
    if policy.get("default") is not None and default is None:
        out.append(invalid(f"{rp}.default", policy.get("default"), "must be a quantity"))
    rng = policy.get("validRange")
    values = policy.get("validValues")
    if rng is not None and values is not None:
        out.append((rp, "Invalid value: \"\": exactly one of `validValues` or `validRange` is allowed"))
    if isinstance(rng, Mapping):
        mn = _quantity(rng.get("min"))
        mx = _quantity(rng.get("max")) if rng.get("max") is not None else None
        if mn is None:
            out.append((f"{rp}.validRange.min", "Required value"))
        else:
            if default is not None and default < mn:
                out.append(invalid(f"{rp}.validRange.min", policy.get("default"),
                                   f"default is less than min: {rng.get('min')}"))
            if mx is not None and mn > mx:
                out.append(invalid(f"{rp}.validRange.max", rng.get("min"), f"min is larger than max: {rng.get('max')}"))
        if mx is not None and mx > value:
            out.append(invalid(f"{rp}.validRange.max", rng.get("max"),
                               f"max is larger than capacity value: {cap['value']}"))
        if mx is not None and default is not None and default > mx and not (mn is not None and mn > mx):
            out.append(invalid(f"{rp}.validRange.max", policy.get("default"),
                               f"default is more than max: {rng['max']}"))
    if isinstance(values, list):
        prev: Decimal | None = None
        for i, v in enumerate(values):
            q = _quantity(v)
            if q is None:
                out.append(invalid(f"{rp}.validValues[{i}]", v, "must be a quantity"))
                continue
            if prev is not None and q <= prev:
                out.append(invalid(f"{rp}.validValues[{i}]", v, "values must be sorted in ascending order"))
            prev = q
    return out


def _counters(path: str, counters: Any) -> list[Cause]:
    out: list[Cause] = []
    if not isinstance(counters, Mapping):
        return [(path, "Required value")]
    for name, c in counters.items():
        if not _DNS_LABEL.match(name):
            out.append(invalid(path, name, DNS_LABEL_MSG))
        if not isinstance(c, Mapping) or _quantity(c.get("value")) is None:
            out.append((f"{path}[{name}].value", "Required value"))
    return out


def _device(path: str, d: Any) -> list[Cause]:
    if not isinstance(d, Mapping):
        return [(path, "Invalid value: must be an object")]
    out: list[Cause] = []
    name = d.get("name", "")
    if not name:
        out.append((f"{path}.name", "Required value"))
    elif "." in name:
        out.append(invalid(f"{path}.name", name, "must not contain dots"))
    elif not _DNS_LABEL.match(name) or len(name) > 63:
        out.append(invalid(f"{path}.name", name, DNS_LABEL_MSG))
    attrs = d.get("attributes") or {}
    for aname in sorted(attrs):
        out += _attribute_name(f"{path}.attributes", aname)
        out += _attribute(f"{path}.attributes", aname, attrs[aname])
    caps = d.get("capacity") or {}
    for cname in sorted(caps):
        out += _attribute_name(f"{path}.capacity", cname)
        out += _capacity(f"{path}.capacity", cname, caps[cname])
    consumes = d.get("consumesCounters") or []
    if len(consumes) > MAX_CONSUMED_SETS:
        out.append((f"{path}.consumesCounters",
                    f"Too many: {len(consumes)}: must have at most {MAX_CONSUMED_SETS} items"))
    for i, cc in enumerate(consumes[:MAX_CONSUMED_SETS]):
        cp = f"{path}.consumesCounters[{i}]"
        if not _DNS_LABEL.match(str((cc or {}).get("counterSet", ""))):
            out.append(invalid(f"{cp}.counterSet", (cc or {}).get("counterSet", ""), DNS_LABEL_MSG))
        out += _counters(f"{cp}.counters", (cc or {}).get("counters"))
    for i, t in enumerate(d.get("taints") or []):
        tp = f"{path}.taints[{i}]"
        if not t.get("key"):
            out.append((f"{tp}.key", "Required value"))
        eff = t.get("effect", "")
        if eff not in TAINT_EFFECTS:
            out.append((f"{tp}.effect", f"Unsupported value: {_q(eff)}: supported values: "
                                        + ", ".join(_q(e) for e in TAINT_EFFECTS)))
    return out


def validate_slice(obj: Mapping[str, Any]) -> list[Cause]:
    spec = obj.get("spec") or {}
    out: list[Cause] = []
    devices = spec.get("devices") or []
    counters = spec.get("sharedCounters") or []
    if devices and counters:
        out.append(("spec", "Invalid value: \"\": only one of `sharedCounters` or `devices` is allowed"))
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(selectors) != 1 and not counters:
        out.append(("spec", "Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                            "`perDeviceNodeSelection` is required"))
    if not spec.get("driver"):
        out.append(("spec.driver", "Required value"))
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        out.append(("spec.pool.name", "Required value"))
    if int(pool.get("resourceSliceCount") or 0) <= 0:
        out.append(("spec.pool.resourceSliceCount", f"Invalid value: {pool.get('resourceSliceCount', 0)}: "
                                                    "must be greater than zero"))
    if int(pool.get("generation") or 0) < 0:
        out.append(("spec.pool.generation", f"Invalid value: {pool.get('generation')}: "
                                            "must be greater than or equal to 0"))
    if len(devices) > MAX_DEVICES:
        out.append(("spec.devices", f"Too many: {len(devices)}: must have at most {MAX_DEVICES} items"))
    else:
        seen: set[str] = set()
        for i, d in enumerate(devices):
            out += _device(f"spec.devices[{i}]", d)
            name = (d or {}).get("name", "")
            if name in seen:
                out.append((f"spec.devices[{i}]", f"Duplicate value: {_q(name)}"))
            seen.add(name)
    if len(counters) > MAX_COUNTER_SETS:
        out.append(("spec.sharedCounters", f"Too many: {len(counters)}: must have at most {MAX_COUNTER_SETS} items"))
    else:
        seen_sets: set[str] = set()
        for i, cs in enumerate(counters):
            name = (cs or {}).get("name", "")
            if name in seen_sets:
                out.append((f"spec.sharedCounters[{i}]", f"Duplicate value: {_q(name)}"))
            elif not _DNS_LABEL.match(name):
                out.append(invalid(f"spec.sharedCounters[{i}].name", name, DNS_LABEL_MSG))
            seen_sets.add(name)
            out += _counters(f"spec.sharedCounters[{i}].counters", (cs or {}).get("counters"))
    return out


def _selectors(path: str, sels: Any) -> list[Cause]:
    out: list[Cause] = []
    for i, s in enumerate(sels or []):
        expr = ((s or {}).get("cel") or {}).get("expression")
        if not expr:
            out.append((f"{path}[{i}].cel.expression", "Required value"))
    return out


def validate_class(obj: Mapping[str, Any]) -> list[Cause]:
    spec = obj.get("spec") or {}
    return _selectors("spec.selectors", spec.get("selectors"))


def validate_claim_spec(spec: Mapping[str, Any], root: str = "spec") -> list[Cause]:
    out: list[Cause] = []
    reqs = ((spec.get("devices") or {}).get("requests")) or []
    seen: set[str] = set()
    for i, r in enumerate(reqs):
        p = f"{root}.devices.requests[{i}]"
        name = (r or {}).get("name", "")
        if not _DNS_LABEL.match(name):
            out.append(invalid(f"{p}.name", name, DNS_LABEL_MSG))
        if name in seen:
            out.append((f"{p}.name", f"Duplicate value: {_q(name)}"))
        seen.add(name)
        exactly = (r or {}).get("exactly")
        first = (r or {}).get("firstAvailable")
        if (exactly is None) == (first is None):
            out.append((p, "Required value: exactly one of `exactly` or `firstAvailable` is required"))
            continue
        subs: list[Any] = [exactly] if exactly is not None else list(first or [])
        for j, sub in enumerate(subs):
            sp = f"{p}.exactly" if exactly is not None else f"{p}.firstAvailable[{j}]"
            if not sub.get("deviceClassName"):
                out.append((f"{sp}.deviceClassName", "Required value"))
            mode = sub.get("allocationMode", "ExactCount")
            if mode not in ("ExactCount", "All"):
                out.append((f"{sp}.allocationMode", f"Unsupported value: {_q(mode)}: supported values: "
                                                     "\"All\", \"ExactCount\""))
            if mode == "ExactCount" and int(sub.get("count", 1)) <= 0:
                out.append(invalid(f"{sp}.count", sub.get("count"), "must be greater than zero"))
            out += _selectors(f"{sp}.selectors", sub.get("selectors"))
            for cname, q in ((sub.get("capacity") or {}).get("requests") or {}).items():
                if _quantity(q) is None:
                    out.append(invalid(f"{sp}.capacity.requests[{cname}]", q, "must be a quantity"))
    return out


def validate(kind: str, obj: Mapping[str, Any]) -> list[Cause]:
    if kind == "ResourceSlice":
        return validate_slice(obj)
    if kind == "DeviceClass":
        return validate_class(obj)
    if kind == "ResourceClaim":
        return validate_claim_spec(obj.get("spec") or {})
    if kind == "ResourceClaimTemplate":
        return validate_claim_spec(((obj.get("spec") or {}).get("spec")) or {}, "spec.spec")
    return []


def api_message(kind: str, group: str, name: str, causes: list[Cause]) -> str:
    """The ``Status.message`` the real server sends for a 422."""
    errs = [f"{p}: {m}" for p, m in causes]
    body = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
    return f'{kind}.{group} "{name}" is invalid: {body}'


def kubectl_message(kind: str, name: str, causes: list[Cause]) -> str:
    """What ``kubectl`` prints for the same 422 (the recordings' form)."""
    errs = [f"{p}: {m}" for p, m in causes]
    if len(errs) == 1:
        return f'The {kind} "{name}" is invalid: {errs[0]}'
    return f'The {kind} "{name}" is invalid: \n' + "\n".join(f"* {e}" for e in errs)


def admit(kind: Any, obj: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """The stand-in API server's admission for ``resource.k8s.io``: default, then validate (422 on causes)."""
    if getattr(kind, "group", "") != "resource.k8s.io":
        return
    from kubegpu_standins.apiserver import ApiStatusError, _now

    if kind.kind == "ResourceSlice":
        old_taints = {}
        for d in ((old or {}).get("spec") or {}).get("devices") or []:
            for t in d.get("taints") or []:
                old_taints[(d.get("name"), t.get("key"), t.get("value"), t.get("effect"))] = t.get("timeAdded")
        for d in (obj.get("spec") or {}).get("devices") or []:
            for t in (d or {}).get("taints") or []:
                if isinstance(t, dict) and not t.get("timeAdded"):
                    key = (d.get("name"), t.get("key"), t.get("value"), t.get("effect"))
                    t["timeAdded"] = old_taints.get(key) or _now()
    causes = validate(kind.kind, obj)
    if causes:
        name = (obj.get("metadata") or {}).get("name", "")
        raise ApiStatusError(422, "Invalid", api_message(kind.kind, kind.group, name, causes))
