"""Step rules on hand-made logits (docs/algorithms.md §2.1, §2.2)."""
import torch

from dblock.decoding.samplers import MaskedBlock, fixed_k_rule, masked_step, threshold_rule, transfer_schedule

V, MASK = 8, 7


def peaked(tokens, probs):
    """Logits whose softmax over the 7 real tokens gives `probs[i]` to `tokens[i]` (MASK gets a huge logit)."""
    rows = []
    for t, p in zip(tokens, probs):
        rest = (1 - p) / 6
        z = torch.log(torch.full((V,), rest))
        z[t] = torch.log(torch.tensor(p))
        z[MASK] = 100.0  # must be ignored
        rows.append(z)
    return torch.stack(rows)


def test_nothing_clears_tau_commits_the_most_confident_lowest_on_ties():
    # rows 1 and 2 are the same logits (a bitwise tie: rows with the peak at different tokens round differently on
    # some CPUs' vector softmax)
    d = threshold_rule(peaked([1, 2, 2], [0.5, 0.6, 0.6]), MASK, 0.95)
    assert d.commit.tolist() == [False, True, False]  # tie between rows 1 and 2 -> lowest
    assert d.tokens.tolist() == [1, 2, 2]


def test_everything_clears_tau():
    d = threshold_rule(peaked([1, 2, 3], [0.96, 0.99, 0.951]), MASK, 0.95)   # (0.95 itself: > tau is rounding)
    assert d.commit.all()


def test_mask_never_predicted_and_conf_excludes_it():
    d = threshold_rule(peaked([4], [0.97]), MASK, 0.95)
    assert d.tokens.tolist() == [4] and abs(d.conf.item() - 0.97) < 1e-5 and d.commit.item()


def test_one_live_position_always_commits():
    d = threshold_rule(peaked([0], [0.2]), MASK, 0.95)
    assert d.commit.tolist() == [True]


def test_max_steps_commits_the_rest():
    b = MaskedBlock(torch.full((3,), MASK), torch.zeros(3, dtype=torch.bool), MASK)
    for _ in range(2):
        masked_step(b, peaked([1, 2, 3][: int(b.live.sum())], [0.3] * int(b.live.sum())), "threshold", 0.95, 3, 0)
    assert int(b.live.sum()) == 1 and b.passes == 2
    masked_step(b, peaked([5], [0.3]), "threshold", 0.95, 3, 0)
    assert b.done and b.first_commit_pass.tolist() == [1, 2, 3]


def test_fixed_k_schedule_and_ties():
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(2, 4) == [1, 1, 0, 0]
    d = fixed_k_rule(peaked([1, 2, 3, 4], [0.5, 0.7, 0.7, 0.1]), MASK, 2)
    assert d.commit.tolist() == [False, True, True, False]
    d = fixed_k_rule(peaked([1, 1, 1], [0.5, 0.5, 0.5]), MASK, 2)      # a bitwise three-way tie -> lowest two
    assert d.commit.tolist() == [True, True, False]


def test_fixed_k_block_finishes_in_steps():
    b = MaskedBlock(torch.tensor([3, MASK, MASK, MASK, MASK]), torch.tensor([True, False, False, False, False]), MASK)
    seen = []
    while not b.done:
        n = int(b.live.sum())
        masked_step(b, peaked([1] * n, [0.4] * n), "fixed-k", 0.95, 64, 3)
        seen.append(n - int(b.live.sum()))
    assert seen == [2, 1, 1] and b.tokens[0].item() == 3  # the fixed prompt row is never touched
