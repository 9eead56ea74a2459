"""Suffix decoding's trees against a brute-force reference over the raw token sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.runtime.spec_decode.suffix_proposer import SuffixProposer, SuffixTree

ALPHABET = 4  # few distinct tokens: many repeats, branches and ties


def occurrences(seqs, path, depth):
    """(seq id, end index) of every place `path` occurs, as a suffix cut at `depth` tokens would hold it."""
    n = len(path)
    if n > depth:
        return []
    return [(sid, s + n - 1) for sid, seq in seqs.items() for s in range(len(seq) - n + 1) if seq[s:s + n] == path]


def brute_count(seqs, path, depth):
    if not path:
        return sum(len(seq) for seq in seqs.values())
    return len(occurrences(seqs, path, depth))


def brute_speculate(seqs, times, depth, context, k, factor, min_prob):
    """The reference: counts by scanning every sequence; ties between children broken by the latest time
    (the global append clock, `times[sid][i]`) at which an occurrence of the longer path ended."""
    context = list(context)[-depth:]
    best = ([], 0.0, 0)
    for m in range(1, len(context) + 1):
        path = context[len(context) - m:]
        if brute_count(seqs, path, depth) == 0:
            break
        limit = max(0, min(k, int(m * factor + 1e-6)))
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < limit:
            options = []
            for t in range(ALPHABET):
                occ = occurrences(seqs, path + [t], depth)
                if occ:
                    options.append((len(occ), max(times[sid][i] for sid, i in occ), t))
            if not options:
                break
            count, _, t = max(options)
            prob *= count / brute_count(seqs, path, depth)
            if prob < min_prob:
                break
            draft.append(t)
            score += prob
            path = path + [t]
        if draft and score >= best[1]:
            best = (draft, score, m)
    return best


def walk(node, path, out):
    for t, child in node.children.items():
        out[tuple(path + [t])] = child.count
        walk(child, path + [t], out)
    return out


def all_paths(seqs, depth):
    return {tuple(seq[s:e]) for seq in seqs.values() for s in range(len(seq))
            for e in range(s + 1, min(len(seq), s + depth) + 1)}


tokens = st.lists(st.integers(0, ALPHABET - 1), max_size=14)


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(1, 6), ops=st.lists(st.tuples(st.integers(0, 3), tokens, st.booleans()), max_size=8))
def test_node_counts_equal_a_scan_of_the_sequences_after_appends_and_removals(depth, ops):
    tree, seqs = SuffixTree(depth), {}
    for sid, new, remove in ops:
        if remove:
            tree.remove(sid)
            seqs.pop(sid, None)
        else:
            tree.extend(sid, new)
            seqs.setdefault(sid, []).extend(new)
    got = walk(tree.root, [], {})
    assert got == {p: brute_count(seqs, list(p), depth) for p in all_paths(seqs, depth)}
    assert tree.root.count == brute_count(seqs, [], depth)


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(1, 8), chunks=st.lists(st.tuples(st.integers(0, 2), tokens), min_size=1, max_size=6),
       context=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=10), k=st.integers(0, 8),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4, 1.0]))
def test_speculation_equals_the_reference(depth, chunks, context, k, factor, min_prob):
    tree, seqs, times, clock = SuffixTree(depth), {}, {}, 0
    for sid, new in chunks:
        for t in new:
            clock += 1
            tree.append(sid, t)
            seqs.setdefault(sid, []).append(t)
            times.setdefault(sid, []).append(clock)
    draft = tree.speculate(context, k, factor, min_prob)
    want, score, match = brute_speculate(seqs, times, depth, context, k, factor, min_prob)
    assert draft.token_ids == want
    for sid, seq in seqs.items():  # a context ending with a sequence: its open suffixes are the matches' nodes
        for ctx in (seq, context + seq):
            own = tree.speculate(ctx, k, factor, min_prob, seq_id=sid)
            assert own.token_ids == brute_speculate(seqs, times, depth, ctx, k, factor, min_prob)[0]
    if want:
        assert (draft.score, draft.match_len) == (pytest.approx(score), match)
        assert len(want) <= min(k, int(match * factor + 1e-6))
        assert all(p >= min_prob for p in draft.probs)


def test_a_long_match_drafts_the_copied_run_and_a_short_ambiguous_one_drafts_little():
    tree = SuffixTree(24)
    passage = list(range(100, 140))
    tree.extend(0, [1, 2] + passage + [3, 4] + passage[:10])
    draft = tree.speculate(tree.seqs[0], 16, 1.0, 0.1)
    assert draft.token_ids == passage[10:20] and draft.match_len == 10  # the copy goes on, as far as it matched
    assert tree.speculate(tree.seqs[0], 16, 2.0, 0.1).token_ids == passage[10:26]  # 2 drafts per matched token
    tree = SuffixTree(24)
    tree.extend(0, [5, 1, 5, 2, 5, 3, 5])  # after 5: 1, 2 or 3, a third each
    assert tree.speculate(tree.seqs[0], 8, 1.0, 0.4).token_ids == []
    assert tree.speculate(tree.seqs[0], 8, 1.0, 0.1).token_ids == [3]  # the most recent of the tied ones


def test_earlier_requests_outputs_are_drafted_and_the_cache_keeps_the_newest_few():
    p = SuffixProposer(16, 2, 1.0, 0.1)
    prompt = [7, 8, 9]
    answer = list(range(50, 70))
    for i in range(3):  # three earlier requests wrote `answer + [i]` after the same prompt
        r = object()
        p.propose(f"r{i}", r, prompt + answer + [i], len(prompt), 4)
        p.free(f"r{i}")
    assert sorted(p.global_tree.seqs) == [1, 2]  # only the last two outputs are kept (LRU by requests)
    assert p._local == {}
    new = object()
    drafts = p.propose("new", new, prompt + answer[:6], len(prompt), 8)
    assert drafts == answer[6:12]  # from the global tree: this request's own tokens have no such run
    p.free("new")
    p0 = SuffixProposer(16, 0, 1.0, 0.1)  # max_cached_requests 0: the request's own tokens only
    p0.propose("a", object(), prompt + answer, len(prompt), 4)
    assert p0.global_tree.seqs == {} and p0.propose("b", object(), prompt + answer[:6], len(prompt), 8) == []


def test_a_request_id_used_again_gets_a_fresh_local_tree():
    p = SuffixProposer(8, 0, 1.0, 0.1)
    p.propose("x", object(), [1, 2, 3, 1, 2], 5, 4)
    assert p.propose("x", object(), [9, 9, 1, 2], 4, 4) == []  # not the old request's [1, 2] -> 3
