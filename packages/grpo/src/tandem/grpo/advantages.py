"""Group-relative advantages: Dr. GRPO (default), GRPO (std-normalised), RLOO, and
mean-normalised (pass-rate) advantages.

Every sample of a prompt's group is scored against the group itself, so no value model is
needed. Dr. GRPO (Liu et al., 2025) keeps only the mean baseline: the std division of the
original GRPO up-weights groups whose rewards barely vary. RLOO (Ahmadian et al., 2024) uses
the mean of the *other* samples, an unbiased baseline. Mean normalisation divides the centred
reward by the group's mean reward: for pass/fail rewards that is the policy gradient of the
sum over prompts of log(pass rate) instead of the mean pass rate: each prompt is pushed in
proportion to one over its pass rate (a success in a group that solves 1 of 8 gets 7, every
failure -1), and the objective falls without bound as any prompt's pass rate goes to 0, so it
does not reward giving up a kind of task the policy rarely solves for one it solves often.

Documented edge cases: a group whose rewards are all equal gets advantage 0 in every mode
(the std division sees 0/(0+eps)), except that `batch_advantages` gives a group whose rewards
are all 0 or below ``failed_group_advantage`` when that is set; a group of one sample gets
advantage 0 (no baseline exists); non-finite rewards are rejected.

Segment chains (``episode_ids``, see `tandem.grpo.segments`): the statistics run over
*episodes*, one reward each, so an episode summarised into three segments does not count
three times in its group's mean, std or size; every segment then gets its episode's value.
"""

from __future__ import annotations

import torch

from tandem.grpo.batch import RolloutBatch
from tandem.grpo.config import GRPOConfig
from tandem.grpo.errors import GRPOError
from tandem.grpo.kl import trajectory_kl
from tandem.grpo.numerics import as_float
from tandem.grpo.segments import Episodes, check_segments


def group_index(
    num_samples: int,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, int]:
    """Dense group index in [0, num_groups) for each sample, and the number of groups.

    Exactly one of ``group_size`` (consecutive samples form a group) or ``group_ids``
    (arbitrary integer ids, in any order) must be given.
    """
    if (group_size is None) == (group_ids is None):
        raise GRPOError("pass exactly one of group_size= (contiguous groups) or group_ids=")
    if group_size is not None:
        if group_size < 1 or num_samples % group_size:
            raise GRPOError(
                f"{num_samples} samples do not split into groups of {group_size}; "
                "pass group_ids= for uneven groups"
            )
        index = torch.arange(num_samples, device=device) // group_size
        return index, num_samples // group_size
    assert group_ids is not None
    if group_ids.shape != (num_samples,):
        raise GRPOError(f"group_ids must have shape ({num_samples},), got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise GRPOError("group_ids must be an integer tensor")
    unique, index = torch.unique(group_ids, return_inverse=True)
    return index.to(device), int(unique.numel())


def _group_sums(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, values
    )


def _episode_view(
    rewards: torch.Tensor,
    group_size: int | None,
    group_ids: torch.Tensor | None,
    episode_ids: torch.Tensor,
) -> tuple[Episodes, torch.Tensor, torch.Tensor]:
    """The rows' episodes, with one reward and one group id per episode (the segments of an
    episode are checked to agree on both)."""
    if group_ids is None or group_size is not None:
        raise GRPOError(
            "episode_ids= needs group_ids= (group_size= would count rows, not episodes)"
        )
    if rewards.dim() != 1:
        raise GRPOError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    group_index(rewards.numel(), group_ids=group_ids)  # shape and dtype checks
    episodes = check_segments(episode_ids, group_ids, rewards)
    return episodes, episodes.gather(rewards), episodes.gather(group_ids)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    std_normalize: bool = False,
    leave_one_out: bool = False,
    eps: float = 1e-6,
    episode_ids: torch.Tensor | None = None,
    mean_normalize: bool = False,
) -> torch.Tensor:
    """Per-sample advantages [N] (float32, or float64 for float64 rewards) from rewards [N] grouped by prompt.

    - default (Dr. GRPO): ``r_i - mean(group)``
    - ``leave_one_out`` (RLOO): ``r_i - mean(group without i)`` = ``G/(G-1) (r_i - mean)``
    - ``std_normalize`` (GRPO): the above divided by ``std(group) + eps`` (unbiased std)
    - ``mean_normalize``: the above divided by ``max(mean(group), 1/G)`` (``G`` the group's
      size; the floor bounds the scale at ``G`` for a group whose mean is at or below 1/G)

    ``episode_ids`` [N] (with ``group_ids``): rows sharing an id are segments of one episode
    and must share its reward and group; the group statistics count episodes, not rows, and
    each segment gets its episode's advantage.
    """
    if std_normalize and mean_normalize:
        raise GRPOError("std_normalize and mean_normalize both rescale the advantages: pick one")
    if episode_ids is not None:
        episodes, ep_rewards, ep_groups = _episode_view(rewards, group_size, group_ids, episode_ids)
        adv = group_advantages(
            ep_rewards,
            group_ids=ep_groups,
            std_normalize=std_normalize,
            leave_one_out=leave_one_out,
            eps=eps,
            mean_normalize=mean_normalize,
        )
        return episodes.spread(adv)
    if rewards.dim() != 1:
        raise GRPOError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    rewards = rewards.detach()
    rewards = rewards if rewards.dtype == torch.float64 else rewards.float()
    if not torch.isfinite(rewards).all():
        raise GRPOError("rewards contain inf/NaN; fix the reward function before training")
    index, num_groups = group_index(rewards.numel(), group_size, group_ids, rewards.device)
    counts = _group_sums(torch.ones_like(rewards), index, num_groups)
    mean = _group_sums(rewards, index, num_groups) / counts
    centred = rewards - mean[index]
    n = counts[index]
    singleton = n < 2
    if leave_one_out:
        centred = torch.where(
            singleton, torch.zeros_like(centred), centred * n / (n - 1).clamp(min=1)
        )
    if std_normalize:
        var = _group_sums((rewards - mean[index]) ** 2, index, num_groups) / (counts - 1).clamp(
            min=1
        )
        centred = centred / (var.sqrt()[index] + eps)
    if mean_normalize:
        centred = centred / torch.maximum(mean, 1 / counts)[index]
    return torch.where(singleton, torch.zeros_like(centred), centred)


def _group_range(
    rewards: torch.Tensor, group_size: int | None, group_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lowest, highest reward of each sample's group, group size of each sample), float64."""
    if rewards.dim() != 1:
        raise GRPOError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    index, num_groups = group_index(rewards.numel(), group_size, group_ids, rewards.device)
    r = rewards.detach().to(torch.float64)
    big = torch.full((num_groups,), float("inf"), dtype=r.dtype, device=r.device)
    low = big.scatter_reduce(0, index, r, reduce="amin")
    high = (-big).scatter_reduce(0, index, r, reduce="amax")
    return low[index], high[index], _group_sums(torch.ones_like(r), index, num_groups)[index]


def nonconstant_groups(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [N]: True for samples whose group's rewards are not all equal (DAPO dynamic sampling).

    ``episode_ids``: as in `group_advantages` (one reward per episode)."""
    if episode_ids is not None:
        episodes, ep_rewards, ep_groups = _episode_view(rewards, group_size, group_ids, episode_ids)
        return episodes.spread(nonconstant_groups(ep_rewards, group_ids=ep_groups))
    low, high, _ = _group_range(rewards, group_size, group_ids)
    return high > low


def failed_groups(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [N]: True for samples of a group of two or more in which every reward is <= 0.

    ``episode_ids``: as in `group_advantages`; "two or more" counts episodes, not segments."""
    if episode_ids is not None:
        episodes, ep_rewards, ep_groups = _episode_view(rewards, group_size, group_ids, episode_ids)
        return episodes.spread(failed_groups(ep_rewards, group_ids=ep_groups))
    _, high, size = _group_range(rewards, group_size, group_ids)
    return (high <= 0) & (size >= 2)


def trained_groups(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    cfg: GRPOConfig,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [N]: the samples a step trains on: all, or (with ``skip_equal_reward_groups``)
    those of groups whose rewards differ, plus all-failed groups when they carry
    ``failed_group_advantage``. Whole groups are kept or dropped, so an episode's segments
    are too."""
    if not cfg.skip_equal_reward_groups:
        return torch.ones_like(rewards, dtype=torch.bool)
    keep = nonconstant_groups(rewards, group_ids=group_ids, episode_ids=episode_ids)
    if cfg.failed_group_advantage:
        keep = keep | failed_groups(rewards, group_ids=group_ids, episode_ids=episode_ids)
    return keep


def batch_advantages(batch: RolloutBatch, cfg: GRPOConfig) -> torch.Tensor:
    """Advantages [B] of a step's batch: given ones, or group advantages of its rewards
    (minus the KL penalty when it is placed in the reward), per episode when the batch has
    ``episode_ids`` (an episode's KL penalty is the sum over all its segments' tokens)."""
    if batch.advantages is not None:
        adv = as_float(batch.advantages)
    else:
        rewards = as_float(batch.rewards)
        if cfg.kl_coef > 0 and cfg.kl_placement == "reward":
            if batch.ref_logprobs is None:
                raise GRPOError("kl_placement='reward' with kl_coef > 0 needs ref_logprobs")
            kl = trajectory_kl(
                batch.rollout_logprobs,
                batch.ref_logprobs,
                batch.loss_mask,
                cfg.kl_estimator,
                cfg.log_ratio_clamp,
            )
            if batch.episode_ids is not None:  # the episode's penalty, on each of its segments
                episodes = Episodes.of(batch.episode_ids, batch.num_sequences, kl.device)
                kl = episodes.spread(episodes.sums(kl))
            rewards = rewards - cfg.kl_coef * kl
        adv = group_advantages(
            rewards,
            group_ids=batch.group_ids,
            std_normalize=cfg.std_normalize,
            leave_one_out=cfg.leave_one_out,
            eps=cfg.std_eps,
            episode_ids=batch.episode_ids,
            mean_normalize=cfg.mean_normalize,
        )
        if cfg.failed_group_advantage:
            failed = failed_groups(
                as_float(batch.rewards), group_ids=batch.group_ids, episode_ids=batch.episode_ids
            )
            adv = torch.where(failed, torch.full_like(adv, cfg.failed_group_advantage), adv)
    if not torch.isfinite(adv).all():
        raise GRPOError("advantages contain inf/NaN; check rewards and batch.advantages")
    return adv
