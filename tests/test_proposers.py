"""Draft proposers without a second model (engine/drafting/): prompt lookup and suffix trees, on integers alone."""

import random

import pytest

from engine.drafting import NgramDrafter, NgramSource, RecentNgrams, RecentOutputs, SuffixDrafter, SuffixTree


def brute_force_lookup(tokens, k, min_n, max_n):
    """The longest n-gram (max_n down to min_n) that ends the context and ended earlier: its latest earlier end's
    next k tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


@pytest.mark.parametrize("min_n, max_n, vocab", [(1, 3, 3), (2, 4, 4), (3, 5, 2)])
def test_prompt_lookup_drafts_what_a_scan_of_the_context_finds(min_n, max_n, vocab):
    rng = random.Random(min_n * 100 + vocab)
    for _ in range(20):
        tokens, drafter = [], NgramDrafter(min_n, max_n)
        for _ in range(60):
            tokens.append(rng.randrange(vocab))
            k = rng.randrange(0, 6)
            want = brute_force_lookup(tokens, k, min_n, max_n) if k else []
            assert drafter.propose(tokens, k) == want  # grown a token at a time
            assert NgramDrafter(min_n, max_n).propose(tokens, k) == want  # and from scratch


def test_prompt_lookup_prefers_the_longest_match_then_the_latest():
    tokens = [1, 2, 3, 8, 4, 2, 3, 7, 1, 2, 3]
    assert NgramDrafter(2, 3).propose(tokens, 3) == [8, 4, 2]  # "1 2 3" beats the later "2 3"
    assert NgramDrafter(2, 2).propose(tokens, 3) == [7, 1, 2]  # among 2-grams the latest "2 3"
    assert NgramDrafter(2, 4).propose([5, 6, 7, 5], 3) == []  # one token is below min_n
    assert NgramDrafter(1, 4).propose([5, 6, 7, 5], 3) == [6, 7, 5]
    assert NgramDrafter(1, 4).propose([5, 6, 7, 5], 0) == []
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def test_recent_outputs_are_a_drafter_shared_by_all_requests():
    source = NgramSource(min_n=2, max_n=8, shared_max_n=4)
    source.finished([40, 41, 42, 43, 44, 45])
    source.finished([50, 41, 42, 60, 61])  # the later "41 42" wins
    own, recent = source.new_drafters()
    assert own is not source.new_drafters()[0]  # one own per request, the recent outputs shared

    def propose(tokens, k):
        return own.propose(tokens, k) or recent.propose(tokens, k)  # as engine/core/speculation.py tries them

    assert propose([1, 2, 41, 42], 3) == [60, 61]
    assert propose([1, 2, 41, 42, 43], 3) == [44, 45]  # "42 43" occurs in the first output only
    assert propose([1, 2, 41, 42, 43, 1, 2], 3) == [41, 42, 43]  # the own context's match comes first
    assert propose([1, 2, 41, 42, 43, 1, 2, 9], 3) == []  # no match anywhere
    assert len(NgramSource(shared=False).new_drafters()) == 1


def brute_force_recent(outputs, capacity, tokens, k, min_n, max_n):
    """The latest outputs that fit `capacity` tokens (the newest whole), searched newest first for the longest
    n-gram that ends the context and has a continuation."""
    kept, total = [], 0
    for out in reversed(outputs):
        if kept and total + len(out) > capacity:
            break
        kept.append(out[-capacity:])
        total += len(out)
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for out in kept:
            for end in range(len(out) - 1, n - 1, -1):
                if out[end - n : end] == suffix:
                    return out[end : end + k]
    return []


def test_recent_ngrams_match_a_scan_of_the_outputs_still_held():
    rng = random.Random(5)
    recent, outputs = RecentNgrams(2, 3, capacity=40), []
    for _ in range(60):
        out = [rng.randrange(4) for _ in range(rng.randrange(1, 25))]
        recent.add(out)
        outputs.append(out)
        for _ in range(5):
            tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
            assert recent.propose(tokens, 4) == brute_force_recent(outputs, 40, tokens, 4, 2, 3)
    for _ in range(40):
        recent.add([9])  # one-token outputs have no n-gram with a continuation: everything older leaves
    assert len(recent) == 0
    long = list(range(100, 100 + 3 * RecentNgrams.MAX_OUTPUT_TOKENS))
    big = RecentNgrams(2, 2, capacity=10 * len(long))
    big.add(long)  # only its first tokens are indexed: the engine's step waits for this
    assert len(big) == RecentNgrams.MAX_OUTPUT_TOKENS - 2
    assert big.propose([100, 101], 2) == [102, 103] and big.propose(long[-2:], 1) == []


def substring_counts(sequences, depth):
    counts = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


def tree_counts(tree):
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_a_suffix_tree_counts_every_substring_up_to_its_depth_and_takes_them_back():
    rng = random.Random(3)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    tree = SuffixTree(depth=5)
    for s in seqs:
        tree.add(s)
    assert tree_counts(tree) == substring_counts(seqs, 5)
    for s in seqs[:3]:
        tree.remove(s)
    assert tree_counts(tree) == substring_counts(seqs[3:], 5)
    for s in seqs[3:]:
        tree.remove(s)
    assert tree.num_nodes() == 0


def test_a_suffix_draft_follows_the_most_frequent_continuation_while_it_stays_likely():
    context = [7, 1, 2, 9, 5, 7, 1, 3, 9, 6, 7, 1, 2, 9, 8, 7, 1]
    # "8 7 1" is new; after "7 1": 2 twice, 3 once; after "7 1 2": 9 both times; after "7 1 2 9": 5 once, 8 once
    drafter = SuffixDrafter(max_spec_factor=4.0)
    assert drafter.propose(context, 3) == [2, 9, 5]  # shares 2/3, 2/3, 1/3 (a tie goes to the smaller id)
    assert SuffixDrafter(max_spec_factor=1.0).propose(context, 3) == [2, 9]  # a 2-token match drafts 2 at most
    assert SuffixDrafter(min_probability=0.5, max_spec_factor=4.0).propose(context, 3) == [2, 9]
    assert SuffixDrafter(min_probability=0.7, max_spec_factor=4.0).propose(context, 3) == []
    assert SuffixDrafter().propose([4, 5, 6], 3) == []  # nothing occurred twice
    assert drafter.propose(context + [3, 9], 2) == [6, 7]  # grown: "7 1 3 9" was followed by "6 7"


def test_a_drafter_grown_a_token_at_a_time_equals_one_built_at_once():
    rng = random.Random(5)
    tokens, grown = [], SuffixDrafter(depth=6, max_spec_factor=2.0)
    for _ in range(80):
        tokens.append(rng.randrange(3))
        assert grown.propose(tokens, 4) == SuffixDrafter(depth=6, max_spec_factor=2.0).propose(tokens, 4)


def test_recent_outputs_of_other_requests_draft_for_a_new_one_until_they_age_out():
    recent = RecentOutputs(depth=8, capacity=1)
    recent.add([5, 6, 7, 8])
    assert SuffixDrafter(recent).propose([1, 5, 6], 3) == [7, 8]  # a 2-token match drafts 2
    recent.add([1, 2])  # the first output ages out
    assert SuffixDrafter(recent).propose([1, 5, 6], 3) == []
    assert tree_counts(recent.tree()) == substring_counts([[1, 2]], 8)


def test_recent_outputs_are_kept_apart_by_salt_under_one_bound():
    """Each salt's requests draft from their own salt's outputs only; the oldest output leaves first whoever's it is,
    so the pools of many salts hold no more than one pool did."""
    recent = RecentNgrams(2, 2, capacity=12)
    for salt in (b"a", b"b", b"c"):
        recent.add([salt[0], 1, 2, 3], salt)  # 4 tokens each: 12 held
    assert [recent.drafter(salt).propose([1, 2], 2) for salt in (b"a", b"b", b"c", b"")] == [[3], [3], [3], []]
    assert recent.drafter(b"a").propose([ord("a"), 1], 2) == [2, 3]
    assert recent.drafter(b"b").propose([ord("a"), 1], 2) == []
    drafter = recent.drafter(b"a")  # made before its salt's pool goes, used after another comes
    recent.add([7, 8, 9], b"d")  # the oldest, a's, leaves
    assert drafter.propose([1, 2], 2) == [] and recent.drafter(b"d").propose([7, 8], 1) == [9]
    assert len(recent) == 2 + 2 + 1  # b's and c's two n-grams with a continuation, and d's one
    recent.add([4, 5, 6], b"a")  # b's leaves
    assert drafter.propose([4, 5], 2) == [6] and recent.drafter(b"b").propose([1, 2], 2) == []
    outputs = RecentOutputs(depth=4, capacity=2)
    trees = SuffixDrafter(outputs, b"a"), SuffixDrafter(outputs, b"b")
    outputs.add([1, 2, 3], b"a")
    outputs.add([1, 2, 4], b"b")
    assert [t.propose([1, 2], 2) for t in trees] == [[3], [4]]
    outputs.add([1, 2, 5], b"c")  # a's leaves: its tree goes with it
    assert outputs.tree(b"a") is None and trees[0].propose([1, 2], 2) == [] and trees[1].propose([1, 2], 2) == [4]
    outputs.add([1, 2, 6], b"a")
    assert trees[0].propose([1, 2], 2) == [6]  # the drafter finds its salt's new tree
