"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's `method: "suffix"`): drafts from suffix trees.

Two kinds of tree over token sequences, each a suffix trie cut at `max_depth` tokens (every suffix of every
sequence, truncated to its first max_depth tokens, is a path from the root; a node counts the suffixes that
pass through it):

    local   one per running sequence: its prompt and output, updated as tokens come
    global  the outputs of earlier and running requests, at most `max_cached_requests` of them, the least
            recently extended dropped first (LRU by requests)

Speculation (`SuffixTree.speculate`, as arctic-inference's `_speculate_path`): for every match length m = 1..
of the context's last tokens (the context cut to max_depth tokens) that is a path in the tree, walk on from
its node to the child with the highest count (ties: the child counted most recently), the estimated
probability of each step multiplying by count(child) / count(node); stop after min(k, floor(m * max_spec_factor))
tokens or when the probability falls below min_token_prob. A draft's score is the sum of its tokens'
probabilities; the best score over m wins (a tie goes to the longer match), and over the local and global
trees. So the match length sets the draft length: a long exact match on a copied passage drafts many
tokens, a short ambiguous one few or none.

Work per step is bounded: appending a token touches at most max_depth nodes per tree (the open suffixes),
and a proposal walks at most max_depth match lengths of at most max_depth + k steps each.

Written here, in pure Python: arctic-inference 0.3.0 (whose C++ suffix tree vLLM uses) ships as an sdist
whose build imports torch >= 2.10, which this project never installs (docs/architecture.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


def _rank(item: tuple[int, Node]) -> tuple[int, int]:
    return item[1].count, item[1].stamp


class Node:
    __slots__ = ("count", "stamp", "children")

    def __init__(self) -> None:
        self.count = 0  # suffixes (of the tree's sequences, cut at max_depth) through this node
        self.stamp = 0  # the tree's clock at the node's last count increment (ties between children)
        self.children: dict[int, Node] = {}


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """A suffix trie of depth max_depth over several sequences (by id), with appends and removals."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.seqs: dict[int, list[int]] = {}
        self._open: dict[int, list[Node]] = {}  # per sequence: the nodes of its suffixes still shorter than max_depth
        self._clock = 0

    def append(self, seq_id: int, token: int) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        seq.append(token)
        self._clock += 1
        opened = [self.root, *self._open.get(seq_id, ())]  # shortest first; the new suffix starts at the root
        grown = []
        for node in opened:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            child.stamp = self._clock
            grown.append(child)
        self.root.count += 1
        # A suffix that reached max_depth tokens stops growing: the oldest open one (the longest) drops out.
        self._open[seq_id] = grown[: self.max_depth - 1]

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(seq_id, int(t))

    def remove(self, seq_id: int) -> None:
        """Take the sequence's suffixes out (nodes whose count falls to 0 are deleted)."""
        seq = self.seqs.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if not seq:
            return
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for t in seq[start : start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break  # the rest of this path hung below it only
                node = child

    def _match(self, context: Sequence[int]) -> Node | None:
        node = self.root
        for t in context:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float, seq_id: int | None = None) -> Draft:
        """The best draft after `context`. `seq_id`: the context ends with that sequence of the tree, whose open
        suffixes are then the nodes of the shorter matches (no walk from the root for those)."""
        context = list(context)[-self.max_depth:]
        opened = self._open.get(seq_id, []) if seq_id is not None else []
        best = Draft()
        for m in range(1, len(context) + 1):
            # The suffix of m tokens: opened[m - 1] while the sequence is that long, else a walk.
            node = opened[m - 1] if m <= len(opened) else self._match(context[len(context) - m:])
            if node is None:
                break  # a longer suffix of the context cannot be a path either
            limit = max(0, min(max_spec_tokens, int(m * max_spec_factor + 1e-6)))
            tokens: list[int] = []
            probs: list[float] = []
            prob, score = 1.0, 0.0
            while len(tokens) < limit and node.children:
                token, child = max(node.children.items(), key=_rank)
                prob *= child.count / node.count
                if prob < min_token_prob:
                    break
                tokens.append(token)
                probs.append(prob)
                score += prob
                node = child
            if tokens and score >= best.score:
                best = Draft(tokens, probs, score, m)
        return best


class _Local:
    __slots__ = ("request", "tree", "num_tokens", "global_id", "num_prompt")

    def __init__(self, request: object, max_depth: int, global_id: int, num_prompt: int) -> None:
        self.request = request
        self.tree = SuffixTree(max_depth)
        self.num_tokens = 0  # the request's tokens already in the local tree
        self.global_id = global_id
        self.num_prompt = num_prompt  # output tokens start here (the global tree takes those only)


class SuffixProposer:
    """The engine's suffix cache: a local tree per running sequence and one global tree of outputs."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._lru: OrderedDict[int, None] = OrderedDict()  # global sequence ids, least recently extended first
        self._local: dict[str, _Local] = {}
        self._next_id = 0

    def _sync(self, key: str, request: object, tokens: Sequence[int], num_prompt: int) -> _Local:
        state = self._local.get(key)
        if state is None or state.request is not request:  # a new request (or a request id used again)
            state = self._local[key] = _Local(request, self.max_depth, self._next_id, num_prompt)
            self._next_id += 1
        new = tokens[state.num_tokens:]
        if len(new):
            state.tree.extend(0, new)
            if self.max_cached > 0:
                out = tokens[max(state.num_tokens, state.num_prompt):]
                if len(out):
                    self.global_tree.extend(state.global_id, out)
                    self._lru[state.global_id] = None
                    self._lru.move_to_end(state.global_id)
                    while len(self._lru) > self.max_cached:
                        old, _ = self._lru.popitem(last=False)
                        self.global_tree.remove(old)
            state.num_tokens = len(tokens)
        return state

    def propose(self, key: str, request: object, tokens: Sequence[int], num_prompt: int, k: int) -> list[int]:
        """Up to k drafts for the sequence `key` whose tokens (prompt + output) are `tokens`."""
        state = self._sync(key, request, tokens, num_prompt)
        if k <= 0:
            return []
        context = tokens[-self.max_depth:]
        own = state.global_id if state.global_id in self._lru else None  # its output, the context's end
        drafts = [state.tree.speculate(context, k, self.max_spec_factor, self.min_token_prob, seq_id=0),
                  self.global_tree.speculate(context, k, self.max_spec_factor, self.min_token_prob, seq_id=own)]
        best = drafts[0] if drafts[0].score >= drafts[1].score else drafts[1]
        return best.token_ids

    def free(self, key: str) -> None:
        """The sequence stopped running: its local tree goes; its output stays in the global tree (LRU)."""
        self._local.pop(key, None)
