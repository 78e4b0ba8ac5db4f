"""YAML text to data at a bounded cost, for every file kubegpu reads (manifests, the node's config file, topology
files): one loader, one nesting limit.

PyYAML's pure-Python scanner is quadratic in flow nesting (100 KB of ``[`` takes 1.5 s to refuse), so libyaml's
parser is used when PyYAML was built with it (much faster on big files too). libyaml's composer recurses in C
without Python's recursion guard: a hostile file nested deeply enough overflows the C stack (a segfault, not an
error). So depth is checked first on the event stream, which is flat; no real file nests anywhere near the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

# libyaml's parser when PyYAML was built with it, else pure Python.
LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_YAML_DEPTH = 200
_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


class TooDeep(ValueError):
    """The text nests deeper than :data:`MAX_YAML_DEPTH` levels."""

    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_YAML_DEPTH} levels")


def check_depth(text: str) -> None:
    """Raise :class:`TooDeep` when ``text`` nests deeper than the limit (``yaml.YAMLError`` when it is not YAML)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=LOADER):
            if isinstance(event, _OPEN):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise TooDeep()
            elif isinstance(event, _CLOSE):
                depth -= 1
    except yaml.YAMLError as exc:
        # Newer libyaml (PyYAML >= 6.0.4) stops flow nesting itself, at 1,000 levels, while scanning ahead of
        # the events counted here: the same verdict, said the same way whichever libyaml is installed.
        if "maximum nesting depth" in str(getattr(exc, "problem", "") or ""):
            raise TooDeep() from None
        raise


def load(text: str) -> Any:
    """The one document of ``text`` (None when empty); raises :class:`TooDeep` or ``yaml.YAMLError``."""
    check_depth(text)
    return yaml.load(text, Loader=LOADER)


def load_all(text: str) -> Iterator[Any]:
    """Every document of ``text``; raises :class:`TooDeep` or ``yaml.YAMLError``."""
    check_depth(text)
    return yaml.load_all(text, Loader=LOADER)
