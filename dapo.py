"""DAPO's four fixes, as a diff on grpo.py (Yu et al. 2025, arXiv 2503.14476).

Article section: "DAPO：四项修正". Each fix is switched on or off alone by train.py
(ablations):

1. Clip-Higher (Sec. 3.1, Eq. 10): decouple the clip range, eps_low = 0.2, eps_high = 0.28. No new
   code: it is `eps_high` of `grpo.ppo_loss`; `EPS_HIGH` below is the paper's value. It acts only
   where the ratio has left 1 (below): at one update per step it is inert.
2. Dynamic Sampling (Sec. 3.2, Eq. 11): drop groups whose G answers are all right or all wrong
   (Eq. 11 keeps 0 < #correct < G) and keep sampling fresh prompts until the step has enough:
   `keep_groups`, `dynamic_sampling`. Such a group's correctness scores are all equal, so without
   shaping its advantages are zero and it carries no policy gradient; the filter reads correctness,
   not the reward, so a group that differs only by the soft overlong penalty is dropped as well.
3. Token-Level Policy Gradient Loss (Sec. 3.3, Eq. 12): divide the summed token losses by the number
   of tokens of the whole batch, not per response:
   `grpo.token_weights(mask, "token", num_tokens=...)`.
4. Overlong Reward Shaping (Sec. 3.4): overlong filtering (truncated responses masked out of the
   loss: `overlong_filter`) and soft overlong punishment (Eq. 13:
   `overlong_penalty`, added to the reward).

DAPO also drops the KL term (beta = 0): for long reasoning the policy is meant to move far from the
initial model; scores a right answer +1 and a wrong one -1 (Sec. 2; train.py --wrong-reward -1), so
the soft overlong penalty in [-1, 0] weighs against a reward gap of 2; and takes 16 optimizer steps
per rollout step, on mini-batches of 512 of its 512 x 16 responses (train.py --mini-batches 16), so
that from the second mini-batch on the policy is off-policy and the clip bounds act. train.py's
--algo dapo keeps one update per step (--mini-batches 1: on the built-in task 4 ended lower,
results/default-dapo-vs-grpo.md), so there the ratio is 1 and Clip-Higher is inert.

Eq. 12 as written divides each prompt group's token sum by that group's tokens; here (as verl and
TRL) the denominator is the tokens of the whole update, so a group with more tokens weighs more.
dapo.py needs torch and grpo.py only: `dynamic_sampling` takes any rollout with the fields of
`Groups` (sampler.Rollout has them).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

import grpo

EPS_LOW, EPS_HIGH = 0.2, 0.28  # Clip-Higher, DAPO Sec. 3.1


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """Soft overlong punishment, DAPO Eq. 13: [N] response lengths -> [N] reward added to the score.

    0 for L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len, falling linearly to -1,
    for max_len - cache_len < L <= max_len; -1 for L > max_len.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    L = lengths.float()                                                       # [N]
    soft = ((max_len - cache_len) - L) / cache_len                            # [N]
    pen = torch.where(L <= max_len - cache_len, torch.zeros_like(L), soft)    # [N]
    return torch.where(L > max_len, torch.full_like(L, -1.0), pen)            # [N]


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: mask [N, T] with the rows of truncated [N] responses zeroed out."""
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]                 # [N, T]


def keep_groups(correct: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling's filter, DAPO Eq. 11 (0 < #correct < G): correctness [B, G] -> bool [B].

    False where a group's G answers are all right or all wrong. It reads correctness (the verifier's
    score), not the shaped reward: an all-correct group whose lengths differ has unequal rewards
    once the soft overlong penalty is added, and keeping it would push a correct answer down.
    """
    return ~grpo.constant_groups(correct)                                     # [B]


class Groups(Protocol):
    """What dynamic sampling reads of a round's rollout (sampler.Rollout is one): G responses per
    prompt, each row's correctness and its prompt's position in the data, and a way to keep some
    groups."""
    G: int
    correct: torch.Tensor                 # [N] the verifier's score of each response
    index: torch.Tensor                   # [N] the position of the row's prompt in the data

    def select_groups(self, keep: torch.Tensor) -> Any: ...  # keep [B] bool -> the kept groups


def dynamic_sampling(
    draw: Callable[[int], tuple[Groups, Any]],
    target: int,
    max_rounds: int,
    gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
    rank: int = 0,
) -> tuple[list, dict[str, float], list[tuple[Groups, Any]]]:
    """Sample rounds of groups until `target` informative groups are kept,
    or `max_rounds` rounds ran.

    draw(round) -> (this rank's rollout for that round (`Groups`), its `correct` [N] filled in;
    anything the caller wants back with it, train.py: the round's timings). With several ranks,
    gather(x [b]) returns every rank's x in rank order: the ranks' keep flags, put in the round's
    global prompt order by the groups' prompt positions (`index`), so all ranks keep the same
    global groups (the first informative ones in prompt order) however the prompts are spread over
    however many ranks, and agree on when to stop. Returns the kept groups of this rank, one
    `select_groups` per round that kept any (empty if it kept none: train.py concatenates them
    with sampler.Rollout.cat), the step's sampling statistics, and every round draw returned, kept
    or not (the step's metrics count them).
    """
    gather = gather or (lambda keep: [keep])
    kept, have, drawn_groups, rounds = [], 0, 0, []
    while have < target and len(rounds) < max_rounds:
        rounds.append(draw(len(rounds)))
        roll = rounds[-1][0]
        keep = keep_groups(roll.correct.view(-1, roll.G))                     # [b]
        parts = gather(keep)                                                  # W x [b_w]
        keep_all = torch.cat(parts)                                    # [B_round], rank order
        order = torch.cat(gather(roll.index[::roll.G].contiguous())).argsort()  # -> prompt order
        drawn_groups += keep_all.numel()
        in_order = keep_all[order]
        take = torch.zeros_like(keep_all)
        # the first informative groups, in prompt order
        take[order] = in_order & (in_order.cumsum(0) <= target - have)
        have += int(take.sum())
        start = sum(p.numel() for p in parts[:rank])
        mine = take[start:start + keep.numel()]                               # [b]
        if bool(mine.any()):
            kept.append(roll.select_groups(mine))
    stats = {"sampling/rounds": float(len(rounds)), "sampling/groups_drawn": float(drawn_groups),
             "sampling/groups_kept": float(have), "sampling/batch_full": float(have >= target)}
    return kept, stats, rounds
