"""A tree of MQTT topic levels, asked in both directions of MQTT 3.1.1 section 4.7's matching.

Each name (a topic, or a topic filter with ``+`` and ``#`` as levels) is a path of levels ending in a node that
holds ``{key: value}`` (the client ids holding a filter, or the topic itself). :meth:`TopicTree.filters_matching`
answers "which filters stored here match this topic", :meth:`TopicTree.topics_matched_by` "which topics stored here
does this filter match"; each costs the levels and branches it follows, not the number of names stored. The rules:
``+`` one whole level, ``#`` the level it stands in and every one below, the parent level too (``sport/#`` matches
``sport``, section 4.7.1.2), and a topic starting with ``$`` matched by no wildcard at its first level (section 4.7.2).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_HERE = None  # the node key holding the {key: value} of the name ending at that node


class TopicTree:
    """Names (topics or filters, levels split on ``/``) each holding ``{key: value}``; a branch left empty by a
    removal is pruned, so a tree emptied of its names is ``{}`` again."""

    def __init__(self) -> None:
        self._root: dict[Any, Any] = {}

    def add(self, name: str, key: Any, value: Any) -> None:
        """Hold ``key: value`` at ``name`` (replacing what ``key`` held there)."""
        node = self._root
        for level in name.split("/"):
            node = node.setdefault(level, {})
        node.setdefault(_HERE, {})[key] = value

    def remove(self, name: str, key: Any) -> None:
        """Drop ``key`` from ``name`` (nothing when it is not there) and the branches this empties."""
        path, node = [], self._root
        for level in name.split("/"):
            if level not in node:
                return
            path.append((node, level))
            node = node[level]
        held = node.get(_HERE, {})
        held.pop(key, None)
        if not held:
            node.pop(_HERE, None)
        for parent, level in reversed(path):
            if parent[level]:
                break
            del parent[level]

    def clear(self) -> None:
        self._root = {}

    def filters_matching(self, topic: str) -> Iterator[dict[Any, Any]]:
        """The ``{key: value}`` of each filter stored here that matches ``topic`` (a topic, no wildcards)."""
        nodes = [self._root]
        for depth, level in enumerate(topic.split("/")):
            wildcards = depth > 0 or not topic.startswith("$")
            following = []
            for node in nodes:
                if wildcards and "#" in node and _HERE in node["#"]:
                    yield node["#"][_HERE]
                if level in node:
                    following.append(node[level])
                if wildcards and "+" in node:
                    following.append(node["+"])
            nodes = following
        for node in nodes:
            if _HERE in node:
                yield node[_HERE]
            if "#" in node and _HERE in node["#"]:  # "a/#" takes "a" too
                yield node["#"][_HERE]

    def topics_matched_by(self, topic_filter: str) -> Iterator[dict[Any, Any]]:
        """The ``{key: value}`` of each topic stored here that ``topic_filter`` (a well-formed filter, section 4.7.1)
        matches: a ``+`` follows every branch of its level, a ``#`` takes its parent and everything below it."""
        nodes = [self._root]
        for depth, level in enumerate(topic_filter.split("/")):
            if level == "#":
                for node in nodes:
                    yield from _held_below(node, depth == 0)
                return
            if level == "+":
                nodes = [child for node in nodes for key, child in node.items()
                         if key is not _HERE and not (depth == 0 and key.startswith("$"))]
            else:
                nodes = [node[level] for node in nodes if level in node]
        for node in nodes:
            if _HERE in node:
                yield node[_HERE]


def _held_below(node: dict[Any, Any], at_root: bool) -> Iterator[dict[Any, Any]]:
    """What ``node`` and every node below it hold, depth first, each level's branches in the order they were made; at
    the root, no branch whose first level starts with ``$``."""
    stack = [child for key, child in reversed(node.items())
             if key is not _HERE and not (at_root and key.startswith("$"))]
    if _HERE in node:
        yield node[_HERE]
    while stack:
        node = stack.pop()
        if _HERE in node:
            yield node[_HERE]
        stack.extend(child for key, child in reversed(node.items()) if key is not _HERE)
