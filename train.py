"""Online RL for language models with GRPO or DAPO: sample, verify, compute advantages, update.

Article section: the whole loop of "GRPO 训练过程拆解" (Step 1 rollouts -> Step 2 rewards -> Step 3
advantages -> Step 4 loss), with "DAPO：四项修正" switched on by --algo dapo and the GRPO-family
objectives of variants.py by --loss, --kl, --entropy-coef and --tis-cap.

    python train.py --algo dapo          # the built-in task and model (base_model/), CPU, a minute
    python train.py --algo grpo --steps 60
    torchrun --standalone --nproc_per_node 8 train.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --data gsm8k.jsonl
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 \
        train.py ...

Step 1 samples with sampler.sample_groups, or with --rollout vllm on a colocated vLLM engine per
rank (harness/vllm_rollout.py) that gets the policy's weights after each step's update.

Distributed data parallel is wired through torchrun's environment variables and is invisible at
world size 1 (infra/parallel.py: DDP, or FSDP2 with --fsdp). Each rank samples a contiguous block of
the step's prompts; a prompt's G samples stay on one rank. With --save-every K a checkpoint (model,
optimizer, scheduler, RNG, step, data position) is written atomically to OUT/checkpoint.pt (with
--fsdp: sharded, to OUT/checkpoint/); --resume continues from it with the same result as an unbroken
run (bitwise on the CPU; on CUDA as close as two unbroken runs: docs/distributed.md).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

import dapo
import grpo
import sampler
import update
import verifier
from harness import bookkeeping, flags, setup
from harness.rollout import RoundsAhead, StepDraw
from harness.rollout import sampling as rollout_context
from infra import parallel

# ---------------------------------------------------------------------------------------------
# The command and the loop
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = flags.parse_train_args(argv, __doc__.split("\n\n")[0])
    with setup.session(args) as ranks:  # torchrun's ranks, OUT/.lock; a user's error: one line
        return run(args, ranks)


def run(args: flags.TrainArgs, ranks: parallel.Dist) -> dict:
    """The run: set-up, the held-out evaluation before the first step, then each step's Steps 1-4,
    its metrics row, evaluation and checkpoint; the final model. Returns the held-out accuracy
    (or mean@n) before and after, and the seconds the loop took."""
    s, state = setup.set_up(args, ranks)
    t_start = time.time()
    if not args.resume:
        state.acc_before = state.acc_after = bookkeeping.held_out(s, args, ranks, 0)
    bar = bookkeeping.progress_bar(args, ranks, state.step)
    for step in bar:
        t0 = parallel.clock()
        # ---- Step 1 + 2: rollouts, rewards (DAPO: dynamic sampling, overlong punishment) ----
        drawn = draw_step(s, args, ranks, state.data_pos)
        state.data_pos += int(drawn.stats["sampling/rounds"]) * args.prompts_per_step

        # ---- Step 3: group advantages (and DAPO's overlong filtering of the loss mask) ----
        advantages, mask = advantages_and_mask(drawn.roll, args, ranks)

        # ---- Step 4: the clipped surrogate, --mini-batches optimizer updates (x --mu passes) ----
        stats = update_step(s, drawn.roll, advantages, mask, args, ranks)

        # ---- metrics, summed over ranks (perf: the phases' model FLOPs); rank 0's files ----
        row = bookkeeping.step_row(s, args, ranks, step, drawn, stats, state.samples, t0)
        state.samples, state.step = row["samples"], step + 1
        if s.out:
            bookkeeping.log_step(s, args, step, row, drawn.roll)
        done = state.step == args.steps or 0 < args.max_samples <= state.samples
        if state.step % args.eval_every == 0 or done:
            state.acc_after = bookkeeping.held_out(s, args, ranks, state.step)
        if args.save_every and (state.step % args.save_every == 0 or done):
            bookkeeping.save_checkpoint(s, args, ranks, state)
        bookkeeping.show_progress(s, bar, row, state.acc_after, done)
        if done:
            break
    return bookkeeping.finish(s, args, ranks, state, time.time() - t_start)


# ---------------------------------------------------------------------------------------------
# Steps 1 + 2: the rollouts and their rewards, in rounds (DAPO's dynamic sampling)
# ---------------------------------------------------------------------------------------------

def draw_step(s: setup.Setup, args: flags.TrainArgs, ranks: parallel.Dist,
              data_pos: int) -> StepDraw:
    """Steps 1 + 2 of a step from the stream's position `data_pos`: one round of draw_round, or with
    --dynamic-sampling rounds until the step's groups are filled (dapo.dynamic_sampling), its first
    rounds drawn together, as many as the step before used (harness.rollout.RoundsAhead)."""
    draw = RoundsAhead(lambda first, k: draw_rounds(s.model, s.task, args, ranks, first, k),
                       data_pos, args.prompts_per_step, args.max_rounds,
                       s.rounds_ahead if args.dynamic_sampling else 1)
    if not args.dynamic_sampling:
        only = draw(0)                                       # (rollout, timings)
        return StepDraw(only[0], {"sampling/rounds": 1.0}, [only])
    kept, stats, rounds = dapo.dynamic_sampling(draw, args.prompts_per_step, args.max_rounds,
                                                ranks.gather, ranks.rank)
    first = rounds[0][0]
    roll = sampler.Rollout.cat(kept) if kept else sampler.Rollout.empty(first.G, first.pad_token_id)
    unused = draw.unused(rounds)
    s.rounds_ahead = len(rounds)                             # the same on every rank
    return StepDraw(roll, {**stats, "sampling/rounds_unused": float(len(unused))}, rounds, unused)


def draw_rounds(model, task: setup.Task, args: flags.TrainArgs, ranks: parallel.Dist, first: int,
                k: int) -> list[tuple]:
    """k rounds from stream position `first` drawn together (one Step 1 and one Step 2 over their
    prompts), as k (rollout, timings), each round's share of the time its own."""
    roll, t = draw_round(model, task, args, ranks, first, k)
    b = roll.num_groups // k                                        # groups a round, this rank
    split = lambda r: roll.select_groups(torch.arange(roll.num_groups) // b == r)  # noqa: E731
    return [(roll if k == 1 else split(r), {key: v / k for key, v in t.items()})
            for r in range(k)]


def draw_round(model, task: setup.Task, args: flags.TrainArgs, ranks: parallel.Dist, first: int,
               rounds: int = 1):
    """Steps 1 + 2 on this rank's share of the prompts first .. first + rounds x prompts_per_step
    - 1 of the stream: the rollout (Step 1) with its Step 2 fields filled in, and its timings."""
    t0 = parallel.clock()
    roll, rows = rollout(model, task, args, ranks, first, rounds)
    t1 = parallel.clock()
    roll = reward(roll, rows, task, args)
    return roll, {"time/sample_s": t1 - t0, "time/reward_s": parallel.clock() - t1}


def rollout(model, task: setup.Task, args: flags.TrainArgs, ranks: parallel.Dist, first: int,
            rounds: int = 1):
    """Step 1: G responses to each of this rank's prompts, every W-th from first + rank (so each
    mini-batch, a K-th of the step's prompt order, spans all W ranks, and every rank has rows in
    every update), of `rounds` rounds' prompts (round r's are the r-th block of this rank's).
    Returns the Rollout and the data rows of its prompts, with their positions."""
    mine = task.prompt_rows(args.seed, first + ranks.rank,
                            rounds * args.prompts_per_step // ranks.world, stride=ranks.world)
    prompts = [task.encode(r["prompt"]) for _, r in mine]
    generators = [task.generator(args.seed, j) for j, _ in mine]             # one per prompt
    G, T = args.group_size, args.max_new_tokens
    engine = task.sample is not None      # --fsdp: the policy gathered once for the whole rollout
    with parallel.unsharded(None if engine else model), \
            rollout_context(model, prompts, args, engine) as slots:
        if engine:                            # --rollout vllm: the engine's own sample_groups
            roll = task.sample(model, prompts, G, T, task.eos, task.pad, args.temperature,
                               args.top_p, generator=generators)
        else:                                 # G answers per prompt, the HF forward + a KV cache
            roll = sampler.sample_groups(model, prompts, G, T, task.eos, task.pad,
                                         args.temperature, args.top_p, generator=generators,
                                         max_num_seqs=slots)
    return roll.cpu(), mine   # one copy: Step 2 reads it row by row, the update slice by slice


def reward(roll, mine: list[tuple[int, dict]], task: setup.Task, args: flags.TrainArgs):
    """Step 2: the rule-based rewards of the rollout's responses -> the Rollout with `correct` (the
    --reward score), `rewards` (what Step 3 compares: the wrong answer's reward, --format-weight,
    DAPO's soft overlong penalty), `index` (each prompt's stream position), `reward_parts`."""
    rows = [r for _, r in mine for _ in range(args.group_size)]
    texts = [task.decode(roll, i) for i in range(len(rows))]
    ids = lambda: [roll.response_ids[i, :n].tolist()  # noqa: E731
                   for i, n in enumerate(roll.lengths)]
    correct, parts = task.reward_fn([r["prompt"] for r in rows], texts, rows, ids)  # [N], name: [N]
    rewards = args.wrong_reward + (1.0 - args.wrong_reward) * correct              # [N]
    if args.format_weight:
        rewards += args.format_weight * torch.tensor([verifier.format_reward(t) for t in texts])
    if args.overlong_penalty:
        rewards += dapo.overlong_penalty(roll.lengths.cpu(), args.max_new_tokens,
                                         args.overlong_cache)
    index = torch.tensor([j for j, _ in mine], dtype=torch.long)             # [B] prompt positions
    return dataclasses.replace(roll, rewards=rewards, correct=correct, reward_parts=parts,
                               index=index.repeat_interleave(args.group_size))  # [N]


# ---------------------------------------------------------------------------------------------
# Step 3: advantages; Step 4: the update
# ---------------------------------------------------------------------------------------------

def reward_std(roll, ranks: parallel.Dist) -> float:
    """The std of all ranks' rewards of the step (--adv-scale batch), Bessel-corrected."""
    r = roll.rewards.double()                                                # [N]
    sums = torch.tensor([r.numel(), r.sum(), (r * r).sum()], dtype=torch.float64)
    n, s1, s2 = ranks.sum(sums).tolist()
    return math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1)) if n > 1 else 0.0


def advantages_and_mask(roll, args: flags.TrainArgs, ranks: parallel.Dist):
    """Step 3: each response's group advantage ([B*G]; --adv-scale batch: over all ranks' rewards)
    and the loss mask ([B*G, T]; DAPO's overlong filtering masks truncated responses out)."""
    batch_std = reward_std(roll, ranks) if args.adv_scale == "batch" else None  # all ranks'
    rewards = roll.rewards.view(-1, args.group_size)                     # [B, G]
    advantages = grpo.group_advantages(rewards, args.adv_scale, batch_std=batch_std)  # [B, G]
    mask = roll.mask                                                     # [B*G, T]
    if args.overlong_filter:
        mask = dapo.overlong_filter(roll.mask, roll.truncated)
    return advantages.view(-1), mask                                     # [B*G], [B*G, T]


def update_step(s: setup.Setup, roll, advantages: torch.Tensor, mask: torch.Tensor,
                args: flags.TrainArgs, ranks: parallel.Dist) -> update.UpdateStats:
    """Step 4: update.update_policy's --mini-batches optimizer updates on the rollout, the lr
    schedule's step; a vLLM engine sleeps through it and gets the updated weights after."""
    if s.engine:
        s.engine.sleep()                         # CUDA: its memory is the update's until push
    stats = update.update_policy(s.learner, roll, advantages, mask, args, ranks)
    s.sched.step()                               # the lr schedule counts rollout steps
    if s.engine:
        s.engine.push(s.model)                   # the updated weights, for what samples next
    return stats


if __name__ == "__main__":
    main()
