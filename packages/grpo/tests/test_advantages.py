"""Group advantages against a naive per-group loop written from the papers' formulas."""

from __future__ import annotations

import statistics

import pytest
import torch

from tandem.grpo import GRPOError, failed_groups, group_advantages, nonconstant_groups


def naive_advantages(
    rewards: list[float],
    groups: list[int],
    std_normalize: bool,
    leave_one_out: bool,
    eps: float = 1e-6,
    mean_normalize: bool = False,
) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if len(members) < 2:
            out.append(0.0)
            continue
        if leave_one_out:  # RLOO: baseline is the mean of the other samples
            others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
            a = r - sum(others) / len(others)
        else:  # Dr. GRPO / GRPO: group mean baseline
            a = r - sum(members) / len(members)
        if std_normalize:  # GRPO: divide by the group's standard deviation
            a = a / (statistics.stdev(members) + eps)
        if mean_normalize:  # log(pass rate): divide by the group's mean, at least 1/G
            a = a / max(sum(members) / len(members), 1 / len(members))
        out.append(a)
    return out


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_ids_match_naive(std_normalize: bool, leave_one_out: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([3, 1, 3, 7, 1, 1, 3, 7, 9, 3], dtype=torch.long)  # uneven, shuffled
    rewards = torch.rand(10, generator=gen, dtype=torch.float64)
    got = group_advantages(
        rewards, group_ids=groups, std_normalize=std_normalize, leave_one_out=leave_one_out
    )
    want = naive_advantages(rewards.tolist(), groups.tolist(), std_normalize, leave_one_out)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_size_matches_naive(std_normalize: bool, leave_one_out: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (24,), generator=gen).float()
    got = group_advantages(
        rewards, group_size=6, std_normalize=std_normalize, leave_one_out=leave_one_out
    )
    want = naive_advantages(
        rewards.tolist(), [i // 6 for i in range(24)], std_normalize, leave_one_out
    )
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_all_equal_group_has_zero_advantage(std_normalize: bool, leave_one_out: bool) -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3])
    adv = group_advantages(
        rewards, group_size=3, std_normalize=std_normalize, leave_one_out=leave_one_out
    )
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros(9))


def test_single_sample_group_is_zero_not_nan() -> None:
    adv = group_advantages(
        torch.tensor([5.0, 1.0, 2.0]),
        group_ids=torch.tensor([0, 1, 1]),
        std_normalize=True,
        leave_one_out=True,
    )
    assert adv[0].item() == 0.0 and torch.isfinite(adv).all()


def test_nonconstant_groups_matches_naive() -> None:
    gen = torch.Generator().manual_seed(2)
    groups = torch.randint(0, 6, (40,), generator=gen)
    rewards = torch.randint(0, 2, (40,), generator=gen).float()
    got = nonconstant_groups(rewards, group_ids=groups)
    for i in range(40):
        members = {rewards[j].item() for j in range(40) if groups[j] == groups[i]}
        assert got[i].item() == (len(members) > 1)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(GRPOError, match="exactly one"):
        group_advantages(torch.ones(4))
    with pytest.raises(GRPOError, match="do not split"):
        group_advantages(torch.ones(5), group_size=2)
    with pytest.raises(GRPOError, match="inf/NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), group_size=2)
    with pytest.raises(GRPOError, match="shape"):
        group_advantages(torch.ones(4), group_ids=torch.zeros(3, dtype=torch.long))


def test_failed_groups_matches_naive() -> None:
    gen = torch.Generator().manual_seed(3)
    groups = torch.randint(0, 8, (40,), generator=gen)
    rewards = torch.randint(0, 2, (40,), generator=gen).float() * (
        torch.rand(40, generator=gen) > 0.5
    )
    got = failed_groups(rewards, group_ids=groups)
    for i in range(40):
        members = [rewards[j].item() for j in range(40) if groups[j] == groups[i]]
        assert got[i].item() == (len(members) >= 2 and max(members) <= 0)
    assert got.any() and not got.all()


def test_failed_group_advantage_is_a_nonpositive_number() -> None:
    from tandem.grpo import GRPOConfig

    with pytest.raises(GRPOError, match="failed_group_advantage"):
        GRPOConfig(failed_group_advantage=0.1)
    with pytest.raises(GRPOError, match="failed_group_advantage"):
        GRPOConfig(failed_group_advantage=float("-inf"))


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_mean_normalize_matches_naive(leave_one_out: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    groups = torch.randint(0, 7, (48,), generator=gen)
    rewards = torch.randint(0, 2, (48,), generator=gen).double() * torch.rand(48, generator=gen)
    rewards[:5] = torch.tensor([0.01, 0.0, 0.02, 0.0, 0.0], dtype=torch.float64)
    groups[:5] = 9  # a group whose mean (0.006) is under its floor, 1/5
    got = group_advantages(
        rewards, group_ids=groups, leave_one_out=leave_one_out, mean_normalize=True
    )
    want = naive_advantages(
        rewards.tolist(), groups.tolist(), False, leave_one_out, mean_normalize=True
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_mean_normalize_pushes_in_proportion_to_one_over_the_pass_rate() -> None:
    """Pass/fail groups of 8: every failure gets -1, as in the gradient of log(pass rate)
    (the pass rate's gradient over the pass rate), so the one success of a prompt solved
    1 time in 8 is pushed (7/8) / (1/8) = 7 times as hard as the seven successes of a prompt
    solved 7 times in 8 together; Dr. GRPO pushes both alike (the mean pass rate's gradient)."""
    rewards = torch.tensor([1.0] + [0.0] * 7 + [1.0] * 7 + [0.0] + [0.0] * 8)
    adv = group_advantages(rewards, group_size=8, mean_normalize=True)
    torch.testing.assert_close(adv[:8], torch.tensor([7.0] + [-1.0] * 7))
    torch.testing.assert_close(adv[8:16], torch.tensor([1 / 7] * 7 + [-1.0]))
    assert torch.equal(adv[16:], torch.zeros(8))  # all failed: no signal, as in every mode
    assert (adv[0] / adv[8:15].sum()).item() == pytest.approx(7.0)
    plain = group_advantages(rewards, group_size=8)
    assert (plain[0] / plain[8:15].sum()).item() == pytest.approx(1.0)


def test_mean_normalize_is_not_combined_with_std() -> None:
    from tandem.grpo import GRPOConfig

    with pytest.raises(GRPOError, match="mean_normalize"):
        GRPOConfig(std_normalize=True, mean_normalize=True)
    with pytest.raises(GRPOError, match="pick one"):
        group_advantages(torch.ones(4), group_size=2, std_normalize=True, mean_normalize=True)
