"""Native schedule: layouts, EOS, counters by hand (scripted executor), and the llada_moe full-sequence layout."""
import torch

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from tests.reference.scripted import ScriptedForward

EOS = 14


def script_mid_block_eos(p):
    # prompt [0..2]; block 0 = [0..3] (row 3 live), block 1 = [4..7], block 2 = [8..11]
    table = {3: (1, 1), 4: (2, 2), 5: (3, 9), 6: (4, 2), 7: (5, 2), 8: (6, 1), 9: (EOS, 1), 10: (7, 1), 11: (8, 1)}
    return table[p]


def test_counters_by_hand_with_eos_mid_block():
    fwd = ScriptedForward(script_mid_block_eos)
    res = generate(fwd, [[9, 9, 9]], DecodeConfig(max_new_tokens=9, block_size=4))
    c = res.counters[0]
    # block 0: row 3 clears tau on pass 1.  block 1: pass 1 nothing clears -> the most confident row (4, conf
    # decreasing with position) commits; pass 2 rows 6, 7 clear, row 5 not (its commit_at is 9) -> fallback? no:
    # rows 6 and 7 clear so only they commit; pass 3 nothing clears -> row 5 commits.  block 2: all clear on pass
    # 1; row 9 is EOS -> the request ends with block 2.
    assert [b.passes for b in c.blocks] == [1, 3, 1]
    assert (c.K, c.F, c.Q) == (3, 5, 5 + 3)
    assert res.tokens[0] == [1, 2, 3, 4, 5, 6, EOS]
    assert c.Y == 7 and res.summary()["TPF"] == 7 / 8
    # the prompt's full blocks: none (P=3 < C); appends after blocks 0 and 1, none after the last
    kinds = [k for k, _ in fwd.calls]
    assert kinds.count("append") == 2 and kinds.count("denoise") == 5
    # the first block holds the prompt tail as fixed, decoded, never-live rows
    first = fwd.calls[0][1][0].segments[0]
    assert first.positions.tolist() == [0, 1, 2, 3] and first.live.tolist() == [False, False, False, True]
    assert first.decoded.tolist() == [True, True, True, False]


def test_eos_in_first_block_ends_request():
    fwd = ScriptedForward(lambda p: (EOS if p == 5 else 2, 1))
    res = generate(fwd, [[1, 2, 3, 4, 5]], DecodeConfig(max_new_tokens=40, block_size=4))
    # P=5: block 1 = [4..7] holds prompt row 4; row 5 is EOS
    assert res.tokens[0] == [EOS] and res.counters[0].K == 1 and res.counters[0].Y == 1
    assert [k for k, _ in fwd.calls] == ["append", "denoise"]  # prefill of block 0, one pass


def test_max_new_tokens_truncates_and_counts():
    fwd = ScriptedForward(lambda p: (3, 1))
    res = generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=6, block_size=4))
    # generation region [4, 10) -> blocks 1 and 2; block 2's rows 10, 11 are decoded but not returned
    assert res.tokens[0] == [3] * 6 and res.counters[0].Y == 6 and res.counters[0].K == 2


def test_no_cache_layout_segments():
    fwd = ScriptedForward(lambda p: (3, 1))
    generate(fwd, [[1, 2, 3, 4, 5]], DecodeConfig(max_new_tokens=8, block_size=4, no_cache=True))
    assert all(k == "denoise" for k, _ in fwd.calls)
    last = fwd.calls[-1][1][0]
    # P=5, region [5, 13): blocks 1..3; the last pass recomputes blocks 0..2 as block-causal prefix segments
    assert [s.role for s in last.segments] == ["prefix", "prefix", "prefix", "current"]
    assert torch.equal(last.visibility, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert last.cache is None


def test_fullseq_layout_for_llada_moe():
    fwd = ScriptedForward(lambda p: (3, 1), family="llada_moe")
    res = generate(fwd, [[1, 2, 3]], DecodeConfig(max_new_tokens=8, block_size=4))
    assert res.tokens[0] == [3] * 8
    first = fwd.calls[0][1][0]
    assert len(first.segments) == 1 and len(first.segments[0]) == 3 + 8  # [prompt ; 2 blocks of MASK]
    assert first.segments[0].live.tolist() == [False] * 3 + [True] * 4 + [False] * 4
    assert res.counters[0].Q == res.counters[0].F == 2


def test_batch_of_requests_keeps_independent_block_states():
    fwd = ScriptedForward(script_mid_block_eos)
    res = generate(fwd, [[9, 9, 9], [9, 9, 9]], DecodeConfig(max_new_tokens=9, block_size=4))
    assert res.tokens[0] == res.tokens[1] == [1, 2, 3, 4, 5, 6, EOS]
    assert res.times.den_calls == 5  # both requests share every denoising call
