"""Loading the package's YAML files (recipes, schedules) with errors that name the file.

Every reader of a recipe or schedule file goes through :func:`load_yaml`, which refuses, each
with one line naming the file and the fix:

- a file larger than :data:`MAX_FILE_BYTES` (a recipe is a few kB), before it is parsed (PyYAML
  composes about 80 kB per second: a 10 MB file took minutes and 1.5 GB before any check ran);
- a file that is not UTF-8 text (a binary file);
- an empty file (nothing but comments or whitespace): settings left out by mistake would
  otherwise all silently take their defaults;
- a key given twice in one mapping (YAML keeps the last: the first setting is silently lost);
- a document of more than :data:`MAX_EXPANDED_NODES` nodes, counted as it is composed (many
  phases or knots), or that many with every alias expanded.

A YAML alias (``*name``) stands for the whole node its anchor (``&name``) names, so a few hundred
bytes of nested aliases describe billions of values (an "alias bomb"): PyYAML builds them as
shared references quickly, but whatever walks the result afterwards (validation, ``repr`` in an
error message, ``copy``) walks every one. A document's size is counted with every alias expanded
(each distinct node once, in time linear in the file), and refused above
:data:`MAX_EXPANDED_NODES`. A recipe is a few hundred nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from energon_ordering.errors import OrderingConfigError, show

__all__ = ["MAX_EXPANDED_NODES", "MAX_FILE_BYTES", "load_yaml"]

#: Nodes a YAML file may hold with every alias expanded (scalars, sequences and mappings).
MAX_EXPANDED_NODES = 100_000
#: Bytes a YAML file may hold: the largest packaged recipe is under 3 kB.
MAX_FILE_BYTES = 1 << 20


class _TooManyNodes(Exception):
    """Raised while composing: the document has more than :data:`MAX_EXPANDED_NODES` nodes
    without counting aliases."""


class _DuplicateKey(Exception):
    """Raised while constructing: a mapping gives ``key`` twice (at 1-based ``lines``)."""

    def __init__(self, key: Any, lines: tuple[int, int]):
        super().__init__(key, lines)
        self.key = key
        self.lines = lines


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that counts the nodes it composes and refuses a key given twice."""

    def __init__(self, text: str):
        super().__init__(text)
        self.nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if not self.check_event(yaml.AliasEvent):
            self.nodes += 1
            if self.nodes > MAX_EXPANDED_NODES:
                raise _TooManyNodes()
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # merged keys (<<) may be overridden, by YAML's rule
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, (seen[key], line))
                    seen[key] = line
                except TypeError:
                    continue  # an unhashable key: PyYAML refuses it itself
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, what: str) -> Any:
    """Parses the YAML file at ``path``.

    Raises:
        OrderingConfigError: No such file; larger than :data:`MAX_FILE_BYTES`; not UTF-8 text;
            empty; not valid YAML; a key given twice in one mapping; or more than
            :data:`MAX_EXPANDED_NODES` nodes, as written or with aliases expanded (``what``
            names the caller).
    """
    path = Path(path)
    if not path.is_file():
        raise OrderingConfigError(f"{what}: no file at {show(str(path))}.")
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise OrderingConfigError(
            f"{what}: {path} is {path.stat().st_size:,} bytes, over the limit of "
            f"{MAX_FILE_BYTES:,} for a recipe or schedule (the packaged recipes are under 3 kB); "
            "is it the right file? Write a long schedule as knots (a few per phase change), not "
            "one entry per step."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OrderingConfigError(
            f"{what}: {path} is not a UTF-8 text file (byte {e.start} is "
            f"0x{raw[e.start]:02x}); is it the right file? A recipe or schedule is YAML text."
        ) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise OrderingConfigError(
                f"{what}: {path} is empty (no YAML document, only whitespace or comments), so "
                "every setting would silently take its default; write the settings as a YAML "
                "mapping (see recipes/), or leave the file out for the defaults."
            )
        size = _expanded_size(node, {}, set())
        if size > MAX_EXPANDED_NODES:
            raise OrderingConfigError(
                f"{what}: {path} expands to more than {MAX_EXPANDED_NODES:,} YAML nodes through "
                "its aliases (*name repeats the node &name marks, so nested aliases multiply); "
                "a configuration is a few hundred. Write the values out, or alias only small "
                "nodes."
            )
        data = loader.construct_document(node)
    except _TooManyNodes:
        raise OrderingConfigError(
            f"{what}: {path} holds more than {MAX_EXPANDED_NODES:,} YAML nodes (values, lists "
            "and mappings, e.g. that many phases or knots); a configuration is a few hundred. "
            "Describe a long schedule with few knots (linear between them)."
        ) from None
    except _DuplicateKey as e:
        first, again = e.lines
        raise OrderingConfigError(
            f"{what}: {path} gives the key {show(e.key)} twice in one mapping (lines {first} and "
            f"{again}); YAML would keep only the last one and silently drop the other: remove "
            "one of them."
        ) from None
    except yaml.YAMLError as e:
        raise OrderingConfigError(f"{what}: {path} is not valid YAML: {e}") from e
    except RecursionError:
        raise OrderingConfigError(
            f"{what}: {path} is nested too deeply to read; a configuration is a few levels deep."
        ) from None
    finally:
        loader.dispose()
    if data is None:
        raise OrderingConfigError(
            f"{what}: {path} is empty (its document is null), so every setting would "
            "silently take its default; write the settings as a YAML mapping (see recipes/), "
            "or leave the file out for the defaults."
        )
    return data


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes under ``node`` (itself included) with aliases expanded, capped just above
    :data:`MAX_EXPANDED_NODES`; each distinct node is visited once (``sizes``).

    Raises:
        yaml.YAMLError: A node contains itself (a recursive alias).
    """
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.composer.ComposerError(
            None, None, "found a recursive alias (a node that contains itself)", node.start_mark
        )
    open_nodes.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children: list[yaml.Node] = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        size = min(size + _expanded_size(child, sizes, open_nodes), MAX_EXPANDED_NODES + 1)
    open_nodes.discard(key)
    sizes[key] = size
    return size
