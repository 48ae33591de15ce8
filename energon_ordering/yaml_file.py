"""Loading the package's YAML files (recipes, schedules) with errors that name the file.

A YAML alias (``*name``) stands for the whole node its anchor (``&name``) names, so a few hundred
bytes of nested aliases describe billions of values (an "alias bomb"): PyYAML builds them as
shared references quickly, but whatever walks the result afterwards (validation, ``repr`` in an
error message, ``copy``) walks every one. A document is composed first, its size counted with
every alias expanded (each distinct node once, in time linear in the file), and refused above
:data:`MAX_EXPANDED_NODES`. A recipe is a few hundred nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from energon_ordering.errors import OrderingConfigError, show

__all__ = ["MAX_EXPANDED_NODES", "load_yaml"]

#: Nodes a YAML file may hold with every alias expanded (scalars, sequences and mappings).
MAX_EXPANDED_NODES = 100_000


def load_yaml(path: str | Path, what: str) -> Any:
    """Parses the YAML file at ``path``; an empty file is ``{}``.

    Raises:
        OrderingConfigError: No such file, not valid YAML, or a document that expands to more
            than :data:`MAX_EXPANDED_NODES` nodes through aliases (``what`` names the caller).
    """
    path = Path(path)
    if not path.is_file():
        raise OrderingConfigError(f"{what}: no file at {show(str(path))}.")
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        size = _expanded_size(node, {}, set())
        if size > MAX_EXPANDED_NODES:
            raise OrderingConfigError(
                f"{what}: {path} expands to more than {MAX_EXPANDED_NODES:,} YAML nodes through "
                "its aliases (*name repeats the node &name marks, so nested aliases multiply); "
                "a configuration is a few hundred. Write the values out, or alias only small "
                "nodes."
            )
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise OrderingConfigError(f"{what}: {path} is not valid YAML: {e}") from e
    except RecursionError:
        raise OrderingConfigError(
            f"{what}: {path} is nested too deeply to read; a configuration is a few levels deep."
        ) from None
    finally:
        loader.dispose()
    return {} if data is None else data


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
