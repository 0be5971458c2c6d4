"""An approximate record of which prompt prefixes each prefill worker holds KV for.

    tree = ApproxPrefixTree(max_chars_per_worker=1 << 20)
    tree.match(prompt)                 # {"http://p0": 812, "http://p1": 40}: chars held
    tree.insert(prompt, "http://p0", now)  # after routing the prompt to p0
    tree.set_cap("http://p0", 186_000)     # what p0's KV cache can hold, in chars
    tree.evict(now)                    # now and then: bound what the router remembers

The router cannot see a worker's KV cache, so, like SGLang's router, it remembers the text
it sent each worker and assumes the worker still holds that prefix's KV. The record is a
radix (compressed) tree over characters shared by all workers: each node holds a run of
characters and, for every worker that was sent text through it, when that worker last
used it. A worker that holds a node holds all its ancestors, so the chars a worker holds
are the sum of its nodes' lengths, and its match for a text is the depth at which the
text's path leaves that worker's nodes.

It is approximate on purpose: a worker's own cache evicts on its own schedule, and
characters are not tokens. A wrong guess costs a cache miss, never a wrong answer; but the
router also predicts a prompt's prefill time from the prefix it believes held, so each
worker's cap should be what its KV cache can hold (`set_cap`; the router sets it from the
blocks the worker reports): a record larger than the cache claims prefixes long evicted.
Characters are Unicode code points (Python str indexing); no normalisation is applied.
"""

from __future__ import annotations

import heapq


class _Node:
    __slots__ = ("text", "parent", "children", "workers")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}   # first char of the child's text -> child
        self.workers: dict[str, float] = {}    # worker -> last time it used this node


def _common_len(a: str, b: str, start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    if b.startswith(a, start):
        return len(a)
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class ApproxPrefixTree:
    """Per-worker prefix record for cache-aware routing (SGLang's router's approximate tree).

    Not thread-safe: the router calls it from one thread (its event loop).
    """

    def __init__(self, max_chars_per_worker: int = 1 << 20) -> None:
        if max_chars_per_worker < 0:
            raise ValueError(f"max_chars_per_worker must be >= 0, got {max_chars_per_worker}")
        self.max_chars_per_worker = max_chars_per_worker
        self._caps: dict[str, int] = {}          # worker -> its own cap (set_cap)
        self._root = _Node("", None)
        self._sizes: dict[str, int] = {}

    def set_cap(self, worker: str, max_chars: int) -> None:
        """At most `max_chars` remembered for `worker` (instead of max_chars_per_worker);
        applied by the next `evict`."""
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        self._caps[worker] = max_chars

    def cap(self, worker: str) -> int:
        return self._caps.get(worker, self.max_chars_per_worker)

    def insert(self, text: str, worker: str, now: float) -> None:
        """Record that `worker` now holds the KV of `text`'s prefix, last used at `now`.

        Every node on the path is stamped with `now`, so an ancestor is never older than
        its descendants and LRU eviction always trims a worker's record from the leaves.
        """
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                node.children[text[i]] = leaf
                self._hold(leaf, worker, now)
                return
            k = _common_len(child.text, text, i)
            if k < len(child.text):
                child = self._split(child, k)
            self._hold(child, worker, now)
            node, i = child, i + k

    def match(self, text: str) -> dict[str, int]:
        """worker -> chars of the longest prefix of `text` it holds (workers with 0 left out).

        Matching does not count as use: only `insert` (the request was sent) refreshes.
        """
        found: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_len(child.text, text, i)
            for worker in child.workers:
                found[worker] = i + k
            if k < len(child.text):
                break
            node, i = child, i + k
        return found

    def size(self, worker: str) -> int:
        """Chars held for `worker` (0 for a worker the tree has never seen)."""
        return self._sizes.get(worker, 0)

    def evict(self, now: float) -> None:
        """Forget each worker's least recently used text until it holds at most the cap.

        Ages are `now` minus the last-use times, so the oldest goes first; a whole node (a
        run of chars) is forgotten at once, so a worker may end somewhat under the cap.
        Among equally old leaves, the one whose text sorts first goes first (deterministic).
        """
        del now  # ordering by age equals ordering by last-use time
        for worker in sorted(self._sizes):
            if self._sizes[worker] > self.cap(worker):
                self._evict_worker(worker)

    def remove_worker(self, worker: str) -> None:
        """Forget everything recorded for `worker` (it left the pool or lost its cache)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if worker in node.workers:
                stack.extend(node.children.values())
                self._release(node, worker)
        self._sizes.pop(worker, None)
        self._caps.pop(worker, None)

    # internals

    def _hold(self, node: _Node, worker: str, now: float) -> None:
        if worker not in node.workers:
            self._sizes[worker] = self._sizes.get(worker, 0) + len(node.text)
        node.workers[worker] = now

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after its first k chars; returns the new upper part."""
        parent = node.parent
        upper = _Node(node.text[:k], parent)
        upper.workers = dict(node.workers)
        parent.children[node.text[0]] = upper
        node.text = node.text[k:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def _release(self, node: _Node, worker: str) -> None:
        """Drop `worker` from `node`; a node nobody holds leaves the tree."""
        del node.workers[worker]
        if not node.workers:
            del node.parent.children[node.text[0]]

    def _is_leaf_for(self, node: _Node, worker: str) -> bool:
        return all(worker not in child.workers for child in node.children.values())

    def _evict_worker(self, worker: str) -> None:
        # heap of this worker's leaves: (last use, visit order, node); leaves are visited in
        # the order their texts sort (siblings by first char), so equal ages go in text order
        heap: list[tuple[float, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if worker in c.workers]
            stack.extend(sorted(held, key=lambda c: c.text[0], reverse=True))
            if node is not self._root and not held:
                heap.append((node.workers[worker], len(heap), node))
        heapq.heapify(heap)
        order = len(heap)
        while heap and self._sizes[worker] > self.cap(worker):
            _, _, node = heapq.heappop(heap)
            self._sizes[worker] -= len(node.text)
            parent = node.parent
            self._release(node, worker)
            if parent is not self._root and self._is_leaf_for(parent, worker):
                heapq.heappush(heap, (parent.workers[worker], order, parent))
                order += 1
        if self._sizes[worker] == 0:
            del self._sizes[worker]
