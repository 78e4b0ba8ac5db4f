"""Parsing and checking of single values and of the file's structured sections (resources, sharing).

Every mistake is a :class:`ConfigError` naming where the value came from and its key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kubegpu.node.config.model import (
    NVIDIA_DOMAIN,
    ConfigError,
    ReplicaDevices,
    ReplicaSharing,
    ReplicatedResource,
    ResourcePattern,
)
from kubegpu.node.config.options import Option

log = logging.getLogger("kubegpu.node.config")

_RESOURCE_PART_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_DOMAIN_RE: Final = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$")
_DURATION_RE: Final = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        # Go's strconv.ParseBool, which NVIDIA's flags use.
        if value in ("1", "t", "T", "TRUE", "true", "True"):
            return True
        if value in ("0", "f", "F", "FALSE", "false", "False"):
            return False
    raise ConfigError(f"{where}: {value!r} is not a boolean (true or false)")


def parse_duration(value: Any, where: str) -> float:
    """Seconds from a Go duration (``90s``, ``1m30s``, ``500ms``) or a number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        else:
            parts = _DURATION_RE.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    else:
        raise ConfigError(f"{where}: {value!r} is not a duration such as 30s or 5m")
    if seconds < 0:
        raise ConfigError(f"{where}: {value!r} is negative")
    return seconds


def _split(value: Any) -> list[str]:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list | tuple):
        out: list[str] = []
        for v in value:
            if not isinstance(v, str):
                raise TypeError(v)
            out += _split(v)
        return out
    raise TypeError(value)


def _parse_value(opt: Option, value: Any, where: str) -> Any:
    if opt.kind == "bool":
        return _parse_bool(value, where)
    if opt.kind == "duration":
        return parse_duration(value, where)
    if opt.kind == "int":
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {value!r} is not an integer")
        if not opt.minimum <= value <= opt.maximum:
            raise ConfigError(f"{where}: {value} is not between {opt.minimum} and {opt.maximum}")
        return value
    if opt.kind == "ints":
        raw = value.split(",") if isinstance(value, str) else value
        if not isinstance(raw, list | tuple):
            raise ConfigError(f"{where}: {value!r} is not a list of numbers")
        out = []
        for item in raw:
            text = item.strip() if isinstance(item, str) else item
            if isinstance(text, str) and text.isdigit():
                text = int(text)
            if isinstance(text, bool) or not isinstance(text, int) or text < 0:
                raise ConfigError(f"{where}: {item!r} is not a channel number")
            out.append(text)
        return tuple(out)
    if opt.kind in ("choices", "list"):
        try:
            items = _split(value)
        except TypeError:
            raise ConfigError(f"{where}: {value!r} is not a string or a list of strings") from None
        if opt.kind == "choices":
            if not items:
                raise ConfigError(f"{where}: empty; want one or more of {', '.join(opt.choices)}")
            for item in items:
                if item not in opt.choices:
                    raise ConfigError(f"{where}: {item!r} is not one of {', '.join(opt.choices)}")
            if len(set(items)) != len(items):
                raise ConfigError(f"{where}: {value!r} names a strategy twice")
        return tuple(items)
    if not isinstance(value, str):
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        else:
            raise ConfigError(f"{where}: {value!r} is not a string")
    if opt.kind == "choice" and value not in opt.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(opt.choices)}")
    return value


# --- the file's structured sections -----------------------------------------------------------------


def _mapping(value: Any, where: str, allowed: Iterable[str]) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    allowed = tuple(allowed)
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}: unknown key (allowed: {', '.join(allowed)})")
    return value


def resource_name(value: Any, where: str) -> str:
    """NVIDIA's ResourceName: ``gpu`` -> ``nvidia.com/gpu``; a domain-qualified name stays."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {value!r} is not a resource name")
    domain, slash, part = value.rpartition("/")
    if not slash:
        domain = NVIDIA_DOMAIN
    if not _DOMAIN_RE.match(domain) or not _RESOURCE_PART_RE.match(part):
        raise ConfigError(f"{where}: {value!r} is not a valid extended resource name")
    return f"{domain}/{part}"


def _patterns(value: Any, where: str) -> tuple[ResourcePattern, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {{pattern, name}}")
    out = []
    for i, item in enumerate(value):
        item = _mapping(item, f"{where}[{i}]", ("pattern", "name"))
        pattern = item.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where}[{i}].pattern: {pattern!r} is not a pattern")
        name = resource_name(item.get("name"), f"{where}[{i}].name")
        out.append(ResourcePattern(pattern=pattern, name=name))
    return tuple(out)


_GPU_UUID_RE: Final = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_MIG_UUID_RE: Final = re.compile(
    r"^MIG-([0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}|GPU-[0-9a-fA-F-]{36}/\d+/\d+)$")


def _replica_devices(value: Any, where: str) -> ReplicaDevices:
    if value is None or value == "all":
        return ReplicaDevices()
    if isinstance(value, str):
        raise ConfigError(f"{where}: devices set as {value!r} but the only valid string input is 'all'")
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{where}: devices set as {value} but a count of devices must be > 0")
        return ReplicaDevices(all=False, count=value)
    if isinstance(value, list) and value:
        ids = []
        for i, item in enumerate(value):
            ref = str(item) if isinstance(item, int) and not isinstance(item, bool) and item >= 0 else item
            if not isinstance(ref, str) or not (
                    re.fullmatch(r"\d+", ref) or re.fullmatch(r"\d+:\d+", ref)
                    or _GPU_UUID_RE.match(ref) or _MIG_UUID_RE.match(ref)):
                raise ConfigError(
                    f"{where}[{i}]: {item!r} is not a GPU index, MIG index (0:1) or device UUID")
            ids.append(ref)
        return ReplicaDevices(all=False, ids=tuple(ids))
    raise ConfigError(f"{where}: {value!r} is not 'all', a count or a list of devices")


def _replica_sharing(value: Any, where: str, mps: bool) -> ReplicaSharing:
    keys = ["renameByDefault", "failRequestsGreaterThanOne", "resources"]
    if not mps:
        keys.append("strategy")  # time-slicing's (only "" is defined)
    v = _mapping(value, where, keys)
    if not v:
        return ReplicaSharing()
    if v.get("strategy") not in (None, ""):
        raise ConfigError(f"{where}.strategy: unknown time-slicing strategy {v['strategy']!r}")
    raw = v.get("resources")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.resources: no resources specified")
    resources = []
    for i, item in enumerate(raw):
        w = f"{where}.resources[{i}]"
        item = _mapping(item, w, ("name", "rename", "devices", "replicas"))
        if "name" not in item:
            raise ConfigError(f"{w}.name: no resource name specified")
        if "replicas" not in item:
            raise ConfigError(f"{w}.replicas: no replicas specified")
        replicas = item["replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ConfigError(f"{w}.replicas: {replicas!r} is not an integer")
        if replicas < 2:
            raise ConfigError(f"{w}.replicas: number of replicas must be >= 2, got {replicas} "
                              "(to stop sharing, remove the sharing section)")
        name = resource_name(item["name"], f"{w}.name")
        rename = resource_name(item["rename"], f"{w}.rename") if item.get("rename") else ""
        resources.append(ReplicatedResource(name=name, replicas=replicas, rename=rename,
                                            devices=_replica_devices(item.get("devices"), f"{w}.devices")))
    names = [r.name for r in resources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.resources: a resource is listed twice")
    return ReplicaSharing(
        rename_by_default=_parse_bool(v.get("renameByDefault", False), f"{where}.renameByDefault"),
        # NVIDIA defaults this to true for MPS (a second replica would not add compute) and
        # false for time-slicing.
        fail_requests_greater_than_one=_parse_bool(v.get("failRequestsGreaterThanOne", mps),
                                                   f"{where}.failRequestsGreaterThanOne"),
        resources=tuple(resources),
    )


def parse_resource_config(items: Iterable[str],
                          where: str = "--resource-config") -> tuple[ReplicatedResource, ...]:
    """The sharing fork's ``<source>:<new name>:<replicas>`` entries as replicated resources."""
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) != 3:
            raise ConfigError(
                f"{where}: {item!r} is not <resource>:<new name>:<replicas> (e.g. gpu:sharedgpu:4)")
        src, dst, n = (p.strip() for p in parts)
        if not re.fullmatch(r"\d+", n) or not 1 <= int(n) <= 10000:
            raise ConfigError(f"{where}: {item!r}: replicas {n!r} is not a whole number from 1 to 10000")
        out.append(ReplicatedResource(name=resource_name(src, f"{where}: {item!r}: resource"),
                                      rename=resource_name(dst, f"{where}: {item!r}: new name"),
                                      replicas=int(n)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: a resource is configured twice")
    return tuple(out)
