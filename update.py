"""Step 4 as it runs: the policy update of one rollout step, in mini-batches and micro-batches.

Article section: "Step 4：计算损失并更新" (the clipped surrogate and the KL term, then a gradient
step); the loss is grpo.policy_loss (surrogate + beta * KL, the surrogate a --loss of variants.py
or grpo.ppo_loss), the training forward logprobs.py. This module only schedules it: which responses
share an optimizer update (--mini-batches, the DAPO paper's 16 updates per step), how many passes
(--mu), which forwards run without gradients (old and reference log-probs), and the denominators
(grpo.token_weights' global counts) that make the summed micro-batch gradients equal to one update
on the whole mini-batch, on any number of ranks.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import grpo
import parallel
import variants
from logprobs import rollout_logprobs
from sampler import Rollout

# --loss: grpo.policy_loss's surrogate, (logp, old_logp, advantages, mask, weights) -> (loss, m)
LOSSES = {"ppo": grpo.ppo_loss, "gspo": variants.gspo_loss, "gspo-token": variants.gspo_token_loss,
          "cispo": variants.cispo_loss}
KL_ESTIMATORS = {"k1": grpo.kl_k1, "k2": grpo.kl_k2, "k3": grpo.kl_k3}  # --kl
UPDATE_SUMS = ("loss", "kl", "entropy", "entropy_tokens", "tokens", "clip/low_frac",
               "clip/high_frac", "clip/dual_frac", "ratio/mean", "grad_norm", "updates",
               "mismatch/abs", "mismatch/kl", "mismatch/tokens")


@dataclass
class Learner:
    """What an update changes or reads besides the batch: policy, reference, optimizer."""
    policy: torch.nn.Module         # the model as backward runs it: DDP-wrapped, or the model
    model: torch.nn.Module          # the model itself (its parameters, FSDP2's unsharded gathers)
    ref: torch.nn.Module | None     # the frozen reference of the beta * KL term (None: beta = 0)
    opt: torch.optim.Optimizer
    amp: Callable                   # () -> the autocast context of --bf16 (off: a no-op context)
    # () -> the context in which `ref` is the reference (LoRA: adapters off)
    as_reference: Callable = contextlib.nullcontext


@dataclass
class UpdateStats:
    """What one step's update_policy measured, summed over ranks (train.step_metrics: the row)."""
    first: dict[str, float]         # UPDATE_SUMS of the first optimizer update (ratio 1)
    rest: dict[str, float]          # UPDATE_SUMS of the others (off-policy: the clip acts) or 0s
    mismatch_max: float             # max |sampler - old log-prob| over the step's tokens, all ranks
    logprob_s: float                # seconds of the no-grad old and reference log-prob passes
    update_s: float                 # seconds of the gradient passes and optimizer steps after them


def minibatch_rows(roll: Rollout, K: int, ddp: parallel.Dist) -> list[slice]:
    """This rank's rows of each of the step's non-empty mini-batches (an empty slice where it has none).

    Mini-batch k holds the k-th K-th of the step's groups in global prompt order (groups sorted by prompt
    index over all ranks), so the same groups share an update on any number of ranks. A rank's groups are
    in prompt order, so its share of each mini-batch is one contiguous block of rows.
    """
    G = roll.G
    idx = roll.index[::G].contiguous()                                   # [b] each group's prompt index
    b_max = ddp.max(idx.numel())
    everyone = torch.cat(ddp.gather(torch.nn.functional.pad(idx, (0, b_max - idx.numel()), value=-1)))  # [W*b_max]
    everyone = everyone[everyone >= 0].sort().values                                             # [B]
    B = everyone.numel()
    if B == 0:
        return []
    mb = torch.searchsorted(everyone, idx) * K // B                                              # [b] mini-batch of each group
    return [slice(int((mb < k).sum()) * G, int((mb <= k).sum()) * G) for k in sorted({p * K // B for p in range(B)})]


def update_policy(learner: Learner, roll: Rollout, advantages, mask, args,
                  ddp: parallel.Dist) -> UpdateStats:
    """--mu passes over --mini-batches optimizer updates of the --loss objective (+ beta * KL with the
    --kl estimator, - entropy_coef * entropy, the surrogate's tokens weighted by truncated IS with
    --tis-cap: grpo.policy_loss) on this rank's rows of `roll` (advantages [N], loss mask [N, T]);
    returns its UpdateStats. `args` is flags.TrainArgs.

    Old log-probs are computed once, before the first update (with one update they equal the current
    ones). Each update's denominators are its mini-batch's global token and response counts (all
    ranks), so the summed micro-batch gradients equal the mini-batch gradient on any number of
    ranks. Every rank runs the same number of backward passes per update (a zero-weight one where it
    has run out), because DDP synchronises in each. The sums (over ranks) hold the clip and ratio
    metrics of the off-policy updates only (all but the first), once there are any: in the first
    update the ratio is exactly 1. The entropy and the sampler/trainer mismatch (Rollout.logprobs
    against the old log-probs) are summed once per row.
    """
    policy, model, ref, amp = learner.policy, learner.model, learner.ref, learner.amp
    mb = args.micro_batch_size
    minibatches = []                                  # per update: (micro slices, tokens, seqs)
    for rows in minibatch_rows(roll, args.mini_batches, ddp):
        n = rows.stop - rows.start
        starts = range(rows.start, rows.start + ddp.max(math.ceil(n / mb)) * mb, mb)
        micro = [slice(a, min(a + mb, rows.stop)) for a in starts]
        m = mask[rows]                                                  # [n, T]
        num_tokens, num_seqs = ddp.sum(m.sum()).float(), ddp.sum((m.sum(-1) > 0).sum()).float()
        minibatches.append((micro, num_tokens, num_seqs))
    passes = [s for micro, _, _ in minibatches for s in micro if s.start < s.stop]
    # how the training forward may run (logprobs.rollout_logprobs): each response with its own prompt under
    # FSDP2, and with gradients under --gradient-checkpointing; one length bucket per slice with several ranks
    nograd = dict(shared_prefix=not args.fsdp, buckets=ddp.world == 1)
    grad = dict(nograd, shared_prefix=not (args.fsdp or args.gradient_checkpointing))
    t0 = time.time()
    several = args.mu * len(minibatches) > 1
    with (torch.no_grad(), amp(), parallel.unsharded(model if several else None),
          parallel.unsharded(ref)):
        # old policy only when it differs from the current one, reference only when beta > 0
        logp_of = lambda m: {(s.start, s.stop): rollout_logprobs(m, roll, s, args.temperature, **nograd)[0]  # noqa: E731
                             for s in passes}                            # (start, stop) -> [n, T]
        old_logp = logp_of(model) if several else None
        with learner.as_reference():
            ref_logp = logp_of(ref) if ref is not None else None
    t_logprob, t0 = time.time() - t0, time.time()
    first = dict.fromkeys(UPDATE_SUMS, 0.0)                           # the first update
    rest = dict.fromkeys(UPDATE_SUMS, 0.0)                            # the others
    abs_max, bonus = 0.0, args.entropy_coef != 0
    dual = {"clip_c": args.clip_c} if args.clip_c else {}             # dual-clip: --loss ppo only
    clip = dict(eps_low=args.eps_low, eps_high=args.eps_high, **dual)
    surrogate = functools.partial(LOSSES[args.loss], **clip)          # the --loss objective
    kl = KL_ESTIMATORS[args.kl]
    for epoch in range(args.mu):
        for k, (micro, num_tokens, num_seqs) in enumerate(minibatches):
            sums = first if epoch == 0 and k == 0 else rest
            learner.opt.zero_grad(set_to_none=True)
            for i, s in enumerate(micro):
                last = i == len(micro) - 1
                with (parallel.grad_sync(policy, last), amp(),
                      parallel.recompute(policy, args.gradient_checkpointing)):
                    if s.start >= s.stop:  # none of this rank's rows: a zero-weight pass for DDP
                        one = torch.zeros(1, 1, dtype=torch.long, device=ddp.device)
                        (policy(input_ids=one).logits.sum() * 0.0).backward()
                        continue
                    logp, ent, valid = rollout_logprobs(policy, roll, s, args.temperature, epoch == 0 or bonus, **grad)
                    key, dev = (s.start, s.stop), logp.device
                    old = old_logp[key] if old_logp is not None else logp.detach()  # [n, T]
                    m_s = mask[s].to(dev)                                   # [n, T]
                    sampler_logp = roll.logprobs[s].to(dev)                 # [n, T], the sampler's
                    # each token's weight: --reduction with this update's global counts
                    w = grpo.token_weights(m_s, args.reduction, num_tokens, args.max_new_tokens,
                                           num_seqs)                        # [n, T]
                    tis = None                                              # --tis-cap: [n, T]
                    if args.tis_cap:
                        tis = variants.tis_weights(old, sampler_logp, m_s, args.tis_cap)
                    ref_s = ref_logp[key] if ref_logp is not None else None  # [n, T]; None: beta 0
                    # Step 4: surrogate (--loss) + beta * KL (--kl), truncated IS on the surrogate
                    loss, m = grpo.policy_loss(logp, old, advantages[s].to(dev), m_s, w, surrogate,
                                               ref_s, args.beta, kl, tis)
                    if bonus:                                               # - coef * entropy
                        loss = loss - args.entropy_coef * variants.entropy_bonus(ent, m_s, w)[0]
                    # DDP averages gradients over ranks; the loss is already a global mean
                    (loss * ddp.world).backward()
                tok = float(m_s.sum())
                sums["loss"] += loss.item()
                sums["tokens"] += tok
                for name in ("kl", "clip/low_frac", "clip/high_frac", "ratio/mean",
                             "clip/dual_frac"):
                    sums[name] += m.get(name, 0.0) * tok
                if epoch == 0:  # entropy and sampler/trainer mismatch, once per response
                    mm = variants.mismatch_metrics(old, sampler_logp, valid)
                    n_valid = float(valid.sum())
                    sums["entropy"] += float((ent.detach() * valid).sum())
                    sums["entropy_tokens"] += n_valid
                    sums["mismatch/abs"] += mm["mismatch/logp_abs_mean"] * n_valid
                    sums["mismatch/kl"] += mm["mismatch/kl"] * n_valid
                    sums["mismatch/tokens"] += n_valid
                    abs_max = max(abs_max, mm["mismatch/logp_abs_max"])
            # the norm is logged with clipping off too (max_norm inf clips nothing)
            max_norm = args.grad_clip if args.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if ddp.master:  # every rank holds the same all-reduced gradient: count its norm once
                sums["grad_norm"] += float(grad_norm)
                sums["updates"] += 1
            learner.opt.step()
    abs_max = torch.cat(ddp.gather(torch.tensor([abs_max], dtype=torch.float64))).max()  # all ranks
    return UpdateStats(ddp.sum_named(first), ddp.sum_named(rest), float(abs_max), t_logprob,
                       time.time() - t0)
