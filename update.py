"""Step 4 as it runs: the policy update of one rollout step, in mini-batches and micro-batches.

Article section: "Step 4: PPO Loss 计算" (the clipped surrogate and the KL term, then a gradient
step); the loss is grpo.policy_loss (surrogate + beta * KL, the surrogate a --loss of
variants.py or grpo.ppo_loss), the training forward logprobs.py. This module only schedules
it: which responses share an optimizer update (--mini-batches, the DAPO paper's 16 updates per
step), how many passes (--mu), which forwards run without gradients (old and reference log-probs),
and the denominators (grpo.token_weights' global counts) that make the summed micro-batch gradients
equal to one update on the whole mini-batch, on any number of ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import correction
import grpo
import variants
from infra import parallel
from logprobs import rollout_logprobs
from sampler import Rollout

# --loss: grpo.policy_loss's surrogate, (logp, old_logp, advantages, mask, weights) -> (loss, m)
LOSSES = {"ppo": grpo.ppo_loss, "gspo": variants.gspo_loss,
          "cispo": variants.cispo_loss, "dppo": variants.dppo_loss, "sapo": variants.sapo_loss}
KL_ESTIMATORS = {"k1": grpo.kl_k1, "k2": grpo.kl_k2, "k3": grpo.kl_k3}  # --kl
UPDATE_SUMS = ("loss", "kl", "entropy", "entropy_tokens", "tokens", "clip/low_frac",
               "clip/high_frac", "clip/dual_frac", "ratio/mean", "grad_norm", "updates",
               "mismatch/abs", "mismatch/kl", "mismatch/tokens", "is/corrected",
               "offpolicy/masked")


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
    """What one step's update_policy measured, summed over ranks (metrics.step_metrics: the row)."""
    first: dict[str, float]         # UPDATE_SUMS of the first optimizer update (ratio 1)
    rest: dict[str, float]          # UPDATE_SUMS of the others (off-policy: the clip acts) or 0s
    mismatch_max: float             # max |sampler - old log-prob| over the step's tokens, all ranks
    logprob_s: float                # seconds of the no-grad old and reference log-prob passes
    update_s: float                 # seconds of the gradient passes and optimizer steps after them
    micro: list[slice] = field(default_factory=list)  # this rank's micro-batches (harness/perf.py)


def minibatch_rows(roll: Rollout, K: int, ranks: parallel.Dist) -> list[slice]:
    """This rank's rows of each of the step's non-empty mini-batches (an empty
    slice where it has none).

    Mini-batch k holds the k-th K-th of the step's groups in global prompt order (groups sorted by
    prompt index over all ranks), so the same groups share an update on any number of ranks. A
    rank's groups are in prompt order, so its share of each mini-batch is one
    contiguous block of rows.
    """
    G = roll.G
    idx = roll.index[::G].contiguous()  # [b] each group's prompt index
    b_max = ranks.max(idx.numel())
    everyone = torch.cat(ranks.gather(
        torch.nn.functional.pad(idx, (0, b_max - idx.numel()), value=-1)))  # [W*b_max]
    everyone = everyone[everyone >= 0].sort().values  # [B]
    B = everyone.numel()
    if B == 0:
        return []
    mb = torch.searchsorted(everyone, idx) * K // B  # [b] mini-batch of each group
    return [slice(int((mb < k).sum()) * G, int((mb <= k).sum()) * G)
            for k in sorted({p * K // B for p in range(B)})]


def update_policy(learner: Learner, roll: Rollout, advantages, mask, args,
                  ranks: parallel.Dist) -> UpdateStats:
    """--mu passes over --mini-batches optimizer updates of the --loss objective (+ beta * KL with
    the --kl estimator, - entropy_coef * entropy, the surrogate's tokens weighted by truncated IS
    with --tis-cap: grpo.policy_loss) on this rank's rows of `roll` (advantages [N], loss mask
    [N, T]); returns its UpdateStats. `args` is flags.TrainArgs.

    Old log-probs are computed once, before the first update (with one update they equal the current
    ones). Each update's denominators are its mini-batch's global token and response counts (all
    ranks), so the summed micro-batch gradients equal the mini-batch gradient on any number of
    ranks. Every rank runs the same number of backward passes per update (a zero-weight one where it
    has run out), because DDP synchronises in each. The sums (over ranks) hold the clip and ratio
    metrics of the off-policy updates only (all but the first), once there are any: in the first
    update the ratio is exactly 1. The entropy and the sampler/trainer mismatch (Rollout.logprobs
    against the old log-probs) are summed once per row.
    """
    minibatches = plan_minibatches(roll, mask, args, ranks)
    several = args.mu * len(minibatches) > 1       # more than one update: old != current policy
    t0 = parallel.clock()
    roll = keep_sampling_mask(learner, roll, minibatches, args, ranks)
    old_logp, ref_logp = fixed_logprobs(learner, roll, minibatches, args, ranks, several)
    batch = StepBatch(roll, advantages, mask, old_logp, ref_logp)
    t1 = parallel.clock()
    t_logprob, t0 = t1 - t0, t1
    first = dict.fromkeys(UPDATE_SUMS, 0.0)                           # the first update
    rest = dict.fromkeys(UPDATE_SUMS, 0.0)                            # the others
    abs_max, loss_fns = 0.0, objective(args)
    for epoch in range(args.mu):
        for k, mb in enumerate(minibatches):
            sums = first if epoch == 0 and k == 0 else rest
            learner.opt.zero_grad(set_to_none=True)
            for i, s in enumerate(mb.micro):
                last = i == len(mb.micro) - 1
                with (parallel.grad_sync(learner.policy, last), learner.amp(),
                      parallel.recompute(learner.policy, args.gradient_checkpointing)):
                    if s.start >= s.stop:  # none of this rank's rows: a zero-weight pass for DDP
                        empty_pass(learner.policy, ranks)
                        continue
                    micro = micro_loss(learner, batch, s, mb, args, ranks, epoch, loss_fns)
                    # DDP averages gradients over ranks; the loss is already a global mean
                    (micro.loss * ranks.world).backward()
                add_loss_sums(sums, micro)
                if epoch == 0:  # entropy and sampler/trainer mismatch, once per response
                    abs_max = max(abs_max, add_once_sums(sums, micro))
            optimizer_step(learner, sums, args, ranks)
    # the gradients are not kept through the rollout, evaluation and the engine's wake-up that
    # follow (the next update's zero_grad would free them only then)
    learner.opt.zero_grad(set_to_none=True)
    abs_max = torch.tensor([abs_max], dtype=torch.float64)
    abs_max = torch.cat(ranks.gather(abs_max)).max()                   # over all ranks
    return UpdateStats(ranks.sum_named(first), ranks.sum_named(rest), float(abs_max), t_logprob,
                       parallel.clock() - t0, [s for mb in minibatches for s in mb.micro
                                          if s.start < s.stop])


# ---------------------------------------------------------------------------------------------
# The parts of an update: the plan of mini- and micro-batches, the no-grad passes, one micro-batch's
# loss, the sums, the optimizer step
# ---------------------------------------------------------------------------------------------

@dataclass
class Minibatch:
    """One optimizer update's share of this rank's rows, with the update's global counts."""
    micro: list[slice]          # this rank's micro-batches (empty slices once it has run out)
    num_tokens: torch.Tensor    # the mini-batch's loss tokens, over all ranks
    num_seqs: torch.Tensor      # its responses with a loss token, over all ranks


@dataclass
class StepBatch:
    """This rank's rows of the step as the update reads them."""
    roll: Rollout
    advantages: torch.Tensor    # [N]
    mask: torch.Tensor          # [N, T] the loss mask
    old_logp: dict | None       # (start, stop) -> [n, T]; None: the current policy's (one update)
    ref_logp: dict | None       # (start, stop) -> [n, T]; None: beta 0, no reference


@dataclass
class MicroLoss:
    """One micro-batch's loss (rows [n] of the step) and what its sums are made of."""
    loss: torch.Tensor          # its share of the update's global mean
    stats: dict[str, float]     # grpo.policy_loss's metrics (kl, clip and ratio fractions)
    mask: torch.Tensor          # [n, T] the loss mask
    old: torch.Tensor           # [n, T] old log-probs
    sampler_logp: torch.Tensor  # [n, T] the sampler's log-probs (Rollout.logprobs)
    ent: torch.Tensor | None    # [n, T] token entropies (the first pass, or with a bonus)
    valid: torch.Tensor         # [n, T] the response's positions


def micro_slices(roll: Rollout, rows: slice, size: int, budget: int) -> list[slice]:
    """rows cut, in order, into contiguous micro-batches of at most `size` responses and `budget`
    padded positions: responses x (longest prompt + longest response), what the per-response
    forward computes and a bound on the shared-prefix one; a response longer than the budget runs
    alone. Each micro-batch is padded to its own longest response (logprobs.py)."""
    G, out, a = roll.G, [], rows.start
    lengths = roll.lengths.tolist()
    while a < rows.stop:
        b, P, T = a, 0, 0
        while b < rows.stop and b - a < size:
            P2, T2 = max(P, len(roll.prompts[b // G])), max(T, lengths[b])
            if b > a and (b - a + 1) * (P2 + T2) > budget:
                break
            P, T, b = P2, T2, b + 1
        out.append(slice(a, b))
        a = b
    return out


def plan_minibatches(roll: Rollout, mask, args, ranks: parallel.Dist) -> list[Minibatch]:
    """This rank's rows of each mini-batch (minibatch_rows) cut into micro-batches by
    --micro-batch-size and --micro-batch-tokens (micro_slices), as many on every rank (DDP
    synchronises in each backward: a rank with fewer runs empty slices), and each update's
    denominators (the mini-batch's over all ranks, whatever the cut)."""
    minibatches = []
    for rows in minibatch_rows(roll, args.mini_batches, ranks):
        micro = micro_slices(roll, rows, args.micro_batch_size, args.micro_batch_tokens)
        micro += [slice(rows.stop, rows.stop)] * (ranks.max(len(micro)) - len(micro))
        rows_mask = mask[rows]                                          # [n, T]
        num_tokens = ranks.sum(rows_mask.sum()).float()
        num_seqs = ranks.sum((rows_mask.sum(-1) > 0).sum()).float()
        minibatches.append(Minibatch(micro, num_tokens, num_seqs))
    return minibatches


def forward_options(args, ranks: parallel.Dist, grad: bool) -> dict:
    """How the training forward may run (logprobs.rollout_logprobs): each response with its own
    prompt under FSDP2, and with gradients under --gradient-checkpointing; one length bucket per
    slice with several ranks."""
    own_prompt = args.fsdp or (grad and args.gradient_checkpointing)
    return dict(shared_prefix=not own_prompt, buckets=ranks.world == 1)


def forward_passes(minibatches: list[Minibatch]) -> list[slice]:
    """This rank's micro-batches of the step that hold rows, in order (the no-grad passes)."""
    return [s for mb in minibatches for s in mb.micro if s.start < s.stop]


def fixed_logprobs(learner: Learner, roll: Rollout, minibatches: list[Minibatch], args,
                   ranks: parallel.Dist, several: bool):
    """The no-grad passes before the first update, (start, stop) -> [n, T] each: the old policy's
    log-probs only when it differs from the current one (`several` updates), the reference's only
    when beta > 0 (else None)."""
    passes = forward_passes(minibatches)
    nograd = forward_options(args, ranks, grad=False)
    with (torch.no_grad(), learner.amp(), parallel.unsharded(learner.model if several else None),
          parallel.unsharded(learner.ref)):
        logp_of = lambda net: {(s.start, s.stop):  # noqa: E731
                               rollout_logprobs(net, roll, s, args.temperature, **nograd)[0]
                               for s in passes}
        old_logp = logp_of(learner.model) if several else None
        with learner.as_reference():
            ref_logp = logp_of(learner.ref) if learner.ref is not None else None
    return old_logp, ref_logp


def keep_sampling_mask(learner: Learner, roll: Rollout, minibatches: list[Minibatch],
                       args, ranks: parallel.Dist) -> Rollout:
    """The rollout with Rollout.kept, the nucleus each token was drawn from at --top-p < 1, so that
    the old, reference and new log-probs are all under it: sampler.py records it; an engine's
    rollout (--rollout vllm) has none, and the policy that sampled finds it
    (correction.nucleus_sizes).

    Whether to gather the sharded policy for it (--fsdp: a collective) is decided by all ranks
    together: a rank that dynamic sampling left no group (Rollout.empty) has no Rollout.kept either,
    and deciding on that alone it entered the all-gather while the others did not."""
    if args.top_p >= 1 or args.temperature == 0:
        return roll
    missing = roll.kept is None and roll.response_ids.shape[0] > 0  # an engine's rows
    if not ranks.max(int(missing)):                                 # none on any rank
        return roll
    with learner.amp(), parallel.unsharded(learner.model):
        if not missing:
            return roll
        kept = correction.nucleus_sizes(learner.model, roll, forward_passes(minibatches),
                                        args.temperature, args.top_p)
    return dataclasses.replace(roll, kept=kept)


def objective(args) -> tuple[Callable, Callable]:
    """(the --loss surrogate with its clip range, the --kl estimator) for grpo.policy_loss."""
    dual = {"clip_c": args.clip_c} if args.clip_c else {}             # dual-clip: --loss ppo only
    clip = dict(eps_low=args.eps_low, eps_high=args.eps_high, **dual)
    return functools.partial(LOSSES[args.loss], **clip), KL_ESTIMATORS[args.kl]


def empty_pass(policy: torch.nn.Module, ranks: parallel.Dist) -> None:
    """A zero-weight forward and backward, for a rank with no rows left in this update: DDP's
    backward is a collective every rank must join."""
    one = torch.zeros(1, 1, dtype=torch.long, device=ranks.device)
    (policy(input_ids=one).logits.sum() * 0.0).backward()


def micro_loss(learner: Learner, batch: StepBatch, s: slice, mb: Minibatch, args,
               ranks: parallel.Dist, epoch: int, loss_fns: tuple[Callable, Callable]) -> MicroLoss:
    """Step 4 on the rows `s`: the training forward, then grpo.policy_loss = surrogate (--loss,
    each token weighted by --reduction with the update's global counts and by the rollout
    correction: --tis-cap's, --off-policy-mask) + beta * KL (--kl), - entropy_coef * entropy."""
    bonus = args.entropy_coef != 0
    logp, ent, valid = rollout_logprobs(learner.policy, batch.roll, s, args.temperature,
                                        epoch == 0 or bonus, entropy_grad=bonus,
                                        **forward_options(args, ranks, True))
    key, dev = (s.start, s.stop), logp.device
    old = batch.old_logp[key] if batch.old_logp is not None else logp.detach()  # [n, T]
    mask_s = batch.mask[s].to(dev)                                   # [n, T]
    sampler_logp = batch.roll.logprobs[s].to(dev)                   # [n, T], the sampler's
    w = grpo.token_weights(mask_s, args.reduction, mb.num_tokens, args.max_new_tokens,
                           mb.num_seqs)                              # [n, T]
    adv = batch.advantages[s].to(dev)                                # [n] or [n, T]
    tis, shares = None, {}                  # the rollout correction's weights [n, T], its shares
    if args.tis_cap:
        tis, shares["is/corrected"] = correction.is_weights(
            old, sampler_logp, mask_s, args.tis_cap, args.is_level, args.is_mode, args.is_low)
    if args.off_policy_mask:
        keep, shares["offpolicy/masked"] = correction.off_policy_mask(
            logp, sampler_logp, adv, mask_s, args.off_policy_mask)
        tis = keep if tis is None else tis * keep
    ref_s = batch.ref_logp[key] if batch.ref_logp is not None else None  # [n, T]; None: beta 0
    surrogate, kl = loss_fns
    loss, stats = grpo.policy_loss(logp, old, adv, mask_s, w, surrogate, ref_s, args.beta, kl,
                                   tis)
    stats.update(shares)
    if bonus:                                                        # - coef * entropy
        loss = loss - args.entropy_coef * variants.entropy_bonus(ent, mask_s, w)[0]
    return MicroLoss(loss, stats, mask_s, old, sampler_logp, ent, valid)


def add_loss_sums(sums: dict[str, float], micro: MicroLoss) -> None:
    """The loss, its tokens, and the token-weighted KL, clip and ratio metrics of a micro-batch."""
    tok = float(micro.mask.sum())
    sums["loss"] += micro.loss.item()
    sums["tokens"] += tok
    for name in ("kl", "clip/low_frac", "clip/high_frac", "ratio/mean", "clip/dual_frac",
                 "is/corrected", "offpolicy/masked"):
        sums[name] += micro.stats.get(name, 0.0) * tok


def add_once_sums(sums: dict[str, float], micro: MicroLoss) -> float:
    """The entropy and the sampler/trainer mismatch of a micro-batch (the first pass only: once
    per response); returns its largest |sampler - old| log-prob."""
    mismatch = variants.mismatch_metrics(micro.old, micro.sampler_logp, micro.valid)
    n_valid = float(micro.valid.sum())
    sums["entropy"] += float((micro.ent.detach() * micro.valid).sum())
    sums["entropy_tokens"] += n_valid
    sums["mismatch/abs"] += mismatch["mismatch/logp_abs_mean"] * n_valid
    sums["mismatch/kl"] += mismatch["mismatch/kl"] * n_valid
    sums["mismatch/tokens"] += n_valid
    return mismatch["mismatch/logp_abs_max"]


def optimizer_step(learner: Learner, sums: dict[str, float], args, ranks: parallel.Dist) -> None:
    """The gradient clipped to --grad-clip (its norm logged with clipping off too: max_norm inf
    clips nothing), counted once (every rank holds the same all-reduced gradient), one AdamW
    step."""
    max_norm = args.grad_clip if args.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), max_norm)
    if ranks.master:
        sums["grad_norm"] += float(grad_norm)
        sums["updates"] += 1
    learner.opt.step()
