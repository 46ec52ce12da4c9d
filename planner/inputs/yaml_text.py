"""The one YAML loader for every YAML file Piper reads (cluster, model, allocation, Slurm
topology): safe YAML (no Python objects), every key once, and bounded work.

An alias (`*name`) repeats a whole anchored node, so a 1 KB file of nested aliases can stand
for billions of values ("billion laughs"); PyYAML builds them as shared objects, but every
walk over the result (validation, an error message) pays the expanded size. The loader counts
each node's expanded size as it composes the document (aliases included, one addition per
node: linear in the file) and refuses a document over MAX_YAML_NODES expanded nodes, before
any value is built. Real files stay far below it: a cluster profile with its measured tables
holds a few thousand nodes, an allocation about ten per host.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from planner.inputs.shown import shown_text

MAX_YAML_NODES = 1_000_000  # expanded scalars, lists and mappings of one document


class YAMLTooLarge(yaml.YAMLError):
    """A YAML value Python cannot build or Piper will not: nesting past the stack, an integer of
    more than 4300 digits, an impossible date, aliases expanding past MAX_YAML_NODES. `problem`
    says which; there is no line (`problem_mark`)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = None


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (a silent typo trap) and a
    document whose aliases expand past MAX_YAML_NODES nodes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.expanded_size: dict[int, int] = {}  # id(node) -> nodes it stands for

    def compose_node(self, parent: Any, index: Any) -> Any:
        node = super().compose_node(parent, index)
        if id(node) in self.expanded_size:  # an alias: its size is known
            return node
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        size = 1 + sum(self.expanded_size[id(child)] for child in children)
        if size > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None,
                f"aliases expand to more than {MAX_YAML_NODES:,} values (an alias bomb?); "
                "write the values out or use fewer aliases",
                node.start_mark,
            )  # fmt: skip
        self.expanded_size[id(node)] = size
        return node


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:  # a list or mapping as a key: SafeLoader's own check refuses it
            continue
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{shown_text(key)}'", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(text: str) -> Any:
    """`text` parsed by UniqueKeyLoader (safe YAML, every key once, aliases bounded). Every fault
    of the text is a yaml.YAMLError: bad syntax, a key given twice (a ConstructorError at its
    line), aliases expanding past MAX_YAML_NODES (a ComposerError at the node), or a
    YAMLTooLarge for nesting past the stack, an integer of more than 4300 digits or another
    value Python's constructors refuse (a date with month 13)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except RecursionError:
        raise YAMLTooLarge("nesting deeper than Python's stack") from None
    except ValueError as exc:  # int() past sys.get_int_max_str_digits(), datetime's checks
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Exceeds the limit" in what:
            what = f"an integer of more than {sys.get_int_max_str_digits()} digits"
        raise YAMLTooLarge(shown_text(what)) from None
    except TypeError as exc:  # a constructor given a node of the wrong kind
        raise YAMLTooLarge(shown_text(str(exc) or type(exc).__name__)) from None


def yaml_fault(exc: yaml.YAMLError) -> str:
    """' at line L (problem)' for a fault of load_yaml, either part left out when unknown."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None)
    return where + (f" ({shown_text(problem, 200)})" if problem else "")
