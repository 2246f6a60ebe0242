"""Reading YAML that a user (or an attacker) wrote: bounded time and memory, one clear error.

`load_yaml_file(path)` and `load_yaml_text(text, source)` parse with PyYAML's safe loader plus limits, and
raise `ConfigError` (never a traceback-worthy exception) for:

- a file over MAX_BYTES, more than MAX_NODES values, or bytes that are not UTF-8;
- nesting deeper than MAX_DEPTH (PyYAML's composer recurses, so a deep document would hit RecursionError);
- a document whose aliases expand to more than MAX_NODES nodes ("billion laughs": a few lines that expand
  to 10^9 values, which any later walk over the data, such as validation or a deep copy, would take
  forever on), or an alias that refers to itself;
- an integer literal with more than MAX_INT_DIGITS digits (Python refuses to parse > 4300 digits, and no
  config value needs more than a handful);
- a mapping that repeats a key (PyYAML would silently keep the last value). Keys merged in with `<<` may
  be overridden, as YAML intends;
- any explicit tag (`!!binary`, `!!python/object`, `!!str`, a custom `!tag`, the bare `!`): a config is
  plain scalars, lists and maps, so nothing a tag could construct (bytes that a schema later turns into a
  string, objects, sets) ever reaches validation or a policy check.

Anchors, aliases and merge keys within the limits work as usual. This module does not validate what the
document means; `plexrl.job.load` and `plexrl.cluster` do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.events import MappingStartEvent, ScalarEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from plexrl.errors import ConfigError, Problem

MAX_BYTES = 256 << 10  # job and cluster configs are a few KiB
MAX_DEPTH = 64
MAX_NODES = 20_000  # values in the document, after alias expansion
MAX_INT_DIGITS = 64


class UnsafeYAML(yaml.YAMLError):
    """A document beyond one of the limits of this module."""


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader with a depth limit and duplicate-key check while composing, and an integer-size check."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        self._nodes += 1
        try:
            if self._nodes > MAX_NODES:
                raise UnsafeYAML(f"more than {MAX_NODES} values; a config is never this large")
            event = self.peek_event()
            line = event.start_mark.line + 1 if event.start_mark is not None else "?"
            if self._depth > MAX_DEPTH:
                raise UnsafeYAML(f"nesting deeper than {MAX_DEPTH} levels (line {line}); a config is never this deep")
            if isinstance(event, ScalarEvent | SequenceStartEvent | MappingStartEvent) and event.tag is not None:
                raise UnsafeYAML(
                    f"the tag {event.tag!r} on line {line}: a config holds plain values, lists and maps only; "
                    "remove the tag (quote the value if it is a string)"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: Any) -> MappingNode:
        node: MappingNode = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if (key.tag, key.value) in seen:
                first = seen[(key.tag, key.value)]
                where = f"on lines {first} and {line}" if first != line else f"twice on line {line}"
                raise UnsafeYAML(f"duplicate key {key.value!r} {where}; keep one of them")
            seen[(key.tag, key.value)] = line
        return node


def _construct_int(loader: yaml.SafeLoader, node: ScalarNode) -> Any:
    digits = sum(c.isalnum() for c in node.value)
    if digits > MAX_INT_DIGITS:
        raise UnsafeYAML(
            f"integer with {digits} digits on line {node.start_mark.line + 1}; "
            f"config numbers have at most {MAX_INT_DIGITS} digits"
        )
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_LimitedLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _expanded_size(root: Node) -> int:
    """Nodes in the document once every alias is expanded (memoised per node, so the cost is the size of
    the composed graph, not of the expansion); raises UnsafeYAML on a cycle or above MAX_NODES."""
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > MAX_NODES:
                raise UnsafeYAML(
                    f"the document expands to more than {MAX_NODES} values through its aliases (&anchor / "
                    "*alias); write the values out or use fewer aliases"
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in active:
            raise UnsafeYAML(f"an alias refers to its own anchor (line {node.start_mark.line + 1})")
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_yaml_text(text: str, source: str) -> Any:
    """Parse one YAML document within this module's limits; None for an empty one. Raises ConfigError
    naming `source` and what is wrong."""
    if len(text) > MAX_BYTES:
        raise ConfigError([Problem(source, f"{len(text)} characters; a config is at most {MAX_BYTES}")], source)
    loader = _LimitedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    except UnsafeYAML as exc:
        raise ConfigError([Problem(source, str(exc))], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(source, f"not valid YAML: {exc}")], source) from None
    except (RecursionError, ValueError) as exc:  # limits above should make these unreachable
        raise ConfigError([Problem(source, f"cannot read this YAML: {type(exc).__name__}: {exc}")], source) from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> Any:
    """Read a UTF-8 YAML file of at most MAX_BYTES and parse it with `load_yaml_text`; raises ConfigError
    (also for a missing file)."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ConfigError([Problem(source, "file not found; check the path (configs/ has examples)")], source)
    if path.stat().st_size > MAX_BYTES:
        raise ConfigError(
            [Problem(source, f"{path.stat().st_size} bytes; a config file is at most {MAX_BYTES} bytes")], source
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            [Problem(source, f"not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); save it as UTF-8")],
            source,
        ) from None
    return load_yaml_text(text, source)
