"""Radix tree from token prefixes to KV-pool slots (SGLang's RadixCache, token granularity).

A finished or retracted request inserts its tokens with their slots; a new request that starts with
a cached prefix reuses those slots and prefills only the rest (multi-turn agent sessions re-send the
whole history each turn, so this is where most of their prompt cost goes). Nodes used by running
requests are locked; unlocked leaves are evicted least-recently-used when the pool runs short.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: np.ndarray  # token ids of this edge
    slots: np.ndarray  # KV-pool slots of those tokens
    parent: Optional["RadixNode"] = None
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    detached: bool = False
    """Cut from the tree by `flush` while a request still used it: its slots are freed on last unlock."""


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixCache:
    def __init__(self, free_slots: Callable[[np.ndarray], None]) -> None:
        self._free_slots = free_slots
        self.reset()

    def reset(self) -> None:
        self.root = RadixNode(np.empty(0, np.int64), np.empty(0, np.int64))
        self.total_tokens = 0
        self.locked_tokens = 0

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    def match_prefix(self, tokens: np.ndarray) -> tuple[np.ndarray, RadixNode]:
        """Slots of the longest cached prefix of `tokens`, and the node where it ends."""
        node, pieces, pos = self.root, [], 0
        node.last_access = next(_clock)
        while pos < len(tokens) and int(tokens[pos]) in node.children:
            child = node.children[int(tokens[pos])]
            n = _common_prefix(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            pieces.append(child.slots)
            node, pos = child, pos + n
        slots = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        return slots, node

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        """Cache `tokens` -> `slots`; returns how many leading tokens were already cached (the
        caller frees its own duplicate slots for those)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            first = int(tokens[pos])
            if first not in node.children:
                leaf = RadixNode(tokens[pos:].copy(), slots[pos:].copy(), parent=node, last_access=next(_clock))
                node.children[first] = leaf
                self.total_tokens += len(leaf.key)
                return pos
            child = node.children[first]
            n = _common_prefix(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            node, pos = child, pos + n
        return pos

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Split `child`'s edge after n tokens; returns the new upper node."""
        upper = RadixNode(child.key[:n], child.slots[:n], parent=child.parent, lock_ref=child.lock_ref,
                          last_access=child.last_access)
        upper.children[int(child.key[n])] = child
        child.parent.children[int(child.key[0])] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    def lock(self, node: RadixNode) -> None:
        """Protect the path root..node from eviction while a request uses it."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.detached:
                if node.lock_ref == 0:
                    self._free_slots(node.slots)
            elif node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    def flush(self) -> None:
        """Forget every cached prefix (their KV is stale after a weight update). Unlocked slots are
        freed now; paths still locked by running requests are detached and freed on their last unlock."""
        self.evict(self.total_tokens)
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            node.detached = True
            stack.extend(node.children.values())
        self.reset()

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self._free_slots(leaf.slots)
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
