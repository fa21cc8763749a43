"""Online RL for language models with GRPO or DAPO: sample, verify, compute advantages, update.

Article section: the whole loop of "GRPO 训练过程拆解" (Step 1 rollouts -> Step 2 rewards -> Step 3
advantages -> Step 4 loss), with "DAPO：四项修正" switched on by --algo dapo and the GRPO-family
objectives of variants.py by --loss, --kl, --entropy-coef and --tis-cap.

    python train.py --algo dapo          # the built-in task and model (base_model/), CPU, minutes
    python train.py --algo grpo --steps 60
    torchrun --standalone --nproc_per_node 8 train.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --data gsm8k.jsonl
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 \
        train.py ...

Step 1 samples with sampler.sample_groups, or with --rollout vllm on a colocated vLLM engine per
rank (vllm_rollout.py) that gets the policy's weights after each step's update.

Distributed data parallel is wired through torchrun's environment variables and is invisible at
world size 1 (parallel.py: DDP, or FSDP2 with --fsdp). Each rank samples a contiguous block of the
step's prompts; a prompt's G samples stay on one rank. With --save-every K a checkpoint (model,
optimizer, scheduler, RNG, step, data position) is written atomically to OUT/checkpoint.pt (with
--fsdp: sharded, to OUT/checkpoint/); --resume continues from it with the same result as an
unbroken run.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

import dapo
import evaluate
import grpo
import sampler
import update
import verifier
from infra import (
    builtin,
    checkpoint,
    curves,
    data,
    flags,
    lora,
    metrics,
    parallel,
    perf,
    vllm_rollout,
)
from sampler import Rollout

USER_ERRORS = (data.InputError, checkpoint.CheckpointError, checkpoint.FolderInUse,
               parallel.ShardingError)  # one line, exit 2


# ---------------------------------------------------------------------------------------------
# The command and the loop
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = flags.parse_train_args(argv, __doc__.split("\n\n")[0])
    ranks = parallel.Dist(args.device, args.fsdp)
    lock = None
    try:
        lock = checkpoint.lock_folder(args.out, ranks)  # rank 0 holds OUT/.lock for the whole run
        return run(args, ranks)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if lock is not None:
            lock.close()
        ranks.close()


def run(args: flags.TrainArgs, ranks: parallel.Dist) -> dict:
    """The run: set-up, the held-out evaluation before the first step, then each step's Steps 1-4,
    its metrics row, evaluation and checkpoint; the final model. Returns the held-out accuracy
    (or mean@n) before and after, and the seconds the loop took."""
    s, state = set_up(args, ranks)
    t_start = time.time()
    if not args.resume:
        state["acc_before"] = state["acc_after"] = held_out(s, args, ranks, 0)
    steps = range(state["step"], args.steps)
    bar, signal = steps, metrics.SignalCheck(args)
    if ranks.master and len(steps):
        bar = tqdm(steps, desc=args.algo, initial=state["step"], total=args.steps,
                   dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # ---- Step 1 + 2: rollouts, rewards (DAPO: dynamic sampling, overlong punishment) ----
        roll, sstats, rounds = draw_step(s, args, ranks, state["data_pos"])
        state["data_pos"] += int(sstats["sampling/rounds"]) * args.prompts_per_step

        # ---- Step 3: group advantages (and DAPO's overlong filtering of the loss mask) ----
        advantages, mask = advantages_and_mask(roll, args, ranks)

        # ---- Step 4: the clipped surrogate, --mini-batches optimizer updates (x --mu passes) ----
        if s.engine:
            s.engine.sleep()                         # CUDA: its memory is the update's until push
        stats = update.update_policy(s.learner, roll, advantages, mask, args, ranks)
        s.sched.step()                               # the lr schedule counts rollout steps
        if s.engine:
            s.engine.push(s.model)                   # the updated weights, for what samples next

        # ---- metrics, summed over ranks (perf: the phases' model FLOPs); rank 0's files ----
        drawn = [r for r, _ in rounds]
        d = ranks.sum_named({**metrics.drawn_sums(drawn),
                             **s.perf.flops(roll, drawn, stats, args, ranks)})
        state["samples"] += int(d["samples"])
        row = step_row(s, args, step, d, stats, sstats, rounds, state["samples"], t0)
        if s.out:
            log_step(s, args, step, row, roll, signal)
        state["step"] = step + 1
        done = state["step"] == args.steps or 0 < args.max_samples <= state["samples"]
        if state["step"] % args.eval_every == 0 or done:
            state["acc_after"] = held_out(s, args, ranks, state["step"])
        if args.save_every and (state["step"] % args.save_every == 0 or done):
            save_checkpoint(s, args, ranks, state)
        if ranks.master and hasattr(bar, "set_postfix"):
            show_progress(bar, row, state["acc_after"], signal.silent)
        if done:
            break
    return finish(s, args, ranks, state, time.time() - t_start)


# ---------------------------------------------------------------------------------------------
# Steps 1-3 of a step
# ---------------------------------------------------------------------------------------------

@dataclass
class Task:
    """What sampling and scoring need besides the policy: the prompts and how answers are read."""
    rows: list[dict]
    encode: Callable[[str | list[dict]], list[int]]  # prompt (text, messages) -> token ids
    decode: Callable[[Rollout, int], str]       # (rollout, row) -> response text
    reward_fn: data.Reward                      # (prompts, responses, rows) -> ([N], parts)
    eos: list[int]
    pad: int
    sample: Callable | None = None              # Step 1: None (sampler.py), or a vLLM engine's


def draw_step(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, data_pos: int):
    """Steps 1 + 2 of a step from the stream's position `data_pos`: one round of draw_round, or with
    --dynamic-sampling rounds until the step's groups are filled (dapo.dynamic_sampling). Returns
    the rollout trained on, the sampling/* metrics and every (rollout, timings) drawn, kept or
    not."""
    def draw(rnd: int) -> tuple[Rollout, dict[str, float]]:
        """Round rnd of this step: the prompts from the step's data position + rnd rounds on."""
        return draw_round(s.model, s.task, args, ranks, data_pos + rnd * args.prompts_per_step)

    if args.dynamic_sampling:
        return dapo.dynamic_sampling(draw, args.prompts_per_step, args.max_rounds, ranks.gather,
                                     ranks.rank)
    rounds = [draw(0)]
    return rounds[0][0], {"sampling/rounds": 1.0}, rounds


def draw_round(model, task: Task, args: flags.TrainArgs, ranks: parallel.Dist, first: int):
    """Steps 1 + 2 on this rank's share of the prompts first .. first + prompts_per_step - 1 of the
    stream: every W-th, from first + rank (so each mini-batch, a K-th of the step's prompt order,
    spans all W ranks, and every rank has rows in every update). Returns the rollout with its
    Step 2 fields filled in (`correct`, `rewards`: DAPO's +-1 and the soft overlong penalty,
    `index`, `reward_parts`), and its timings."""
    t0 = time.time()
    block = args.prompts_per_step // ranks.world
    mine = data.prompt_rows(task.rows, args.seed, first + ranks.rank, block,
                            stride=ranks.world)
    prompts = [task.encode(r["prompt"]) for _, r in mine]
    generators = [data.prompt_generator(args.seed, j) for j, _ in mine]      # one per prompt
    with parallel.unsharded(None if task.sample else model):  # an engine holds its own weights
        roll = sampler.sample_rollout(model, prompts, args.group_size, args.temperature,
                                      args.top_p, generators, task.eos, task.pad, args,
                                      task.sample)
    t1 = time.time()
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
    roll = dataclasses.replace(roll, rewards=rewards, correct=correct, reward_parts=parts,
                               index=index.repeat_interleave(args.group_size))  # [N]
    return roll, {"time/sample_s": t1 - t0, "time/reward_s": time.time() - t1}


def reward_std(roll: Rollout, ranks: parallel.Dist) -> float:
    """The std of all ranks' rewards of the step (--adv-scale batch), Bessel-corrected."""
    r = roll.rewards.double()                                                # [N]
    sums = torch.tensor([r.numel(), r.sum(), (r * r).sum()], dtype=torch.float64)
    n, s1, s2 = ranks.sum(sums).tolist()
    return math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1)) if n > 1 else 0.0


def advantages_and_mask(roll: Rollout, args: flags.TrainArgs, ranks: parallel.Dist):
    """Step 3: each response's group advantage ([B*G]; --adv-scale batch: over all ranks' rewards)
    and the loss mask ([B*G, T]; DAPO's overlong filtering masks truncated responses out)."""
    batch_std = reward_std(roll, ranks) if args.adv_scale == "batch" else None  # all ranks'
    rewards = roll.rewards.view(-1, args.group_size)                     # [B, G]
    advantages = grpo.group_advantages(rewards, args.adv_scale, batch_std=batch_std)  # [B, G]
    mask = roll.mask                                                     # [B*G, T]
    if args.overlong_filter:
        mask = dapo.overlong_filter(roll.mask, roll.truncated)
    return advantages.view(-1), mask                                     # [B*G], [B*G, T]


# ---------------------------------------------------------------------------------------------
# After the update: the metrics row, rank 0's files, held-out evaluation, checkpoints, the end
# ---------------------------------------------------------------------------------------------

def step_row(s: Setup, args: flags.TrainArgs, step: int, d: dict[str, float],
             stats: update.UpdateStats, sstats: dict[str, float], rounds: list, samples: int,
             t0: float) -> dict:
    """The step's metrics.jsonl row: drawn_sums `d` and the update's `stats` (both over all ranks)
    as metrics.step_metrics, the learning rate, the sampling/*, time/*, memory/* and perf/* keys."""
    row = {"step": step + 1, **metrics.step_metrics(d, stats, args.mu, args.clip_c),
           "lr": s.sched.get_last_lr()[0], "samples": samples, **sstats,
           "time/sample_s": sum(t["time/sample_s"] for _, t in rounds),
           "time/reward_s": sum(t["time/reward_s"] for _, t in rounds),
           "time/logprob_s": stats.logprob_s, "time/update_s": stats.update_s,
           "time/step_s": time.time() - t0}
    own_ref = None if s.ref is s.model else s.ref  # the bytes rank 0 holds (--fsdp: its shards)
    row["memory/state_bytes"] = parallel.state_bytes(s.model, s.learner.opt, own_ref)
    row.update(s.perf.metrics(d, row))           # MFU and tokens/s: d's FLOPs over the times
    return row


def log_step(s: Setup, args: flags.TrainArgs, step: int, row: dict, roll: Rollout,
             signal: metrics.SignalCheck) -> None:
    """Rank 0: the row to metrics.jsonl, the no-signal warnings (once each, in plain words) and a
    few completions of the batch trained on, to read what the policy writes."""
    s.out.log(row)
    for warning in signal(row):
        tqdm.write(warning, file=sys.stderr)
    s.out.completions(step + 1,
                      metrics.sampled_completions(roll, s.tokenizer, args.log_completions))


def held_out(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, step: int) -> float | None:
    """Held-out metrics (evaluate.py; split over ranks) logged; returns accuracy, or mean@n."""
    if not s.eval_rows:
        return None
    with parallel.unsharded(None if s.engine else s.model):  # --fsdp: gathered once for all
        m, _ = evaluate.evaluate_model(s.model, s.tokenizer, s.eval_rows, args, ranks,
                                       s.task.reward_fn, s.task.sample)
    if s.out:
        s.out.log({"step": step, **m})
    return m[evaluate.headline(args.eval_samples)]


def save_checkpoint(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, state: dict) -> None:
    """--save-every: the logs synced to disk first (a checkpoint never runs ahead of them), then
    OUT/checkpoint.pt from rank 0, or with --fsdp every rank's shards under OUT/checkpoint/."""
    if s.out:
        s.out.sync()
    if args.fsdp:
        checkpoint.save_sharded(s.ckpt_path, s.model, s.learner.opt, s.sched, state, ranks)
    elif ranks.master:
        checkpoint.save(s.ckpt_path, s.model, s.learner.opt, s.sched, state)


def show_progress(bar, row: dict, acc: float | None, silent: bool) -> None:
    """Rank 0's progress bar: the step's reward and length, the last held-out accuracy, the MFU
    and tokens/s, and signal=none when the step trained nothing."""
    bar.set_postfix(reward=f"{row['reward/correct']:.2f}", len=f"{row['len/mean']:.0f}",
                    **({"eval": f"{acc:.2f}"} if acc is not None else {}),
                    **({"mfu": f"{100 * row['perf/mfu']:.3g}%"} if "perf/mfu" in row else {}),
                    **{"tok/s": f"{row['perf/tokens_per_s']:.0f}"},
                    **({"signal": "none"} if silent else {}))


def finish(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, state: dict,
           elapsed: float) -> dict:
    """The end: the whole model saved to OUT/final by rank 0 (FSDP2: gathered; LoRA's adapters
    merged, and OUT/adapter alone), the summary line, --plot's OUT/curves.png."""
    weights = lora.merged_state_dict(s.model) if args.lora_r else parallel.full_state_dict(s.model)
    if s.engine:
        s.engine.close()
    if ranks.master:
        adapter = None
        if args.lora_r:
            adapter = lambda tmp: lora.save_adapter(s.model, s.lora_config, tmp)  # noqa: E731
        final = checkpoint.save_final(args.out, s.model, s.tokenizer, weights, adapter)
        s.out.close()
        what = "greedy accuracy" if args.eval_samples == 1 else f"mean@{args.eval_samples}"
        acc = ""
        if s.eval_rows and state["acc_before"] is not None:
            acc = (f"held-out {what} {state['acc_before']:.3f} -> {state['acc_after']:.3f} "
                   f"({len(s.eval_rows)} problems); ")
        print(f"{acc}{state['step']} steps, {state['samples']} samples in {elapsed:.0f}s; "
              f"model saved to {final}")
        if args.plot:
            png = os.path.join(args.out, "curves.png")
            if curves.plot_runs({args.algo: [metrics.read_metrics(s.out.metrics_path)]}, png):
                print(f"curves: {png}")
    return {"acc_before": state["acc_before"], "acc_after": state["acc_after"], "seconds": elapsed}


# ---------------------------------------------------------------------------------------------
# Set-up: the data, the policy and its reference, the rollout engine, the optimizer, the resume
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What the loop runs on, made once by set_up."""
    task: Task                          # the training prompts, their encoding, reward, Step 1
    eval_rows: list[dict]               # held-out rows ([] without --eval-data)
    tokenizer: object
    model: torch.nn.Module              # the policy itself (FSDP2: sharded in place)
    lora_config: object | None          # --lora-r: the adapters' config, for OUT/adapter
    ref: torch.nn.Module | None         # the KL term's reference (None: beta 0)
    engine: vllm_rollout.Engine | None  # --rollout vllm
    learner: update.Learner
    sched: torch.optim.lr_scheduler.LambdaLR
    ckpt_path: str                      # OUT/checkpoint.pt, or OUT/checkpoint/ with --fsdp
    out: metrics.RunLog | None          # rank 0's run files; None on the other ranks
    perf: perf.Meter                    # the policy's FLOPs per token and the peak: perf/*


def set_up(args: flags.TrainArgs, ranks: parallel.Dist) -> tuple[Setup, dict]:
    """Everything the loop needs, in this order (the order the seeded RNG is drawn in), and the
    run's counters: step, data position, samples, accuracy before and after (a resumed run's)."""
    if args.prompts_per_step % ranks.world:
        raise data.InputError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the "
                              f"{ranks.world} ranks")
    torch.manual_seed(args.seed)
    reward_fn, train_rows, eval_rows = load_data(args)
    ckpt_path = find_checkpoint(args)
    path, tokenizer, model, lora_config = load_policy(args, ranks)
    meter = perf.Meter.start(model, args, ranks)  # --peak-tflops, a GPU's by name, or a probe
    task = make_task(args, tokenizer, model, train_rows, eval_rows, reward_fn)
    ref = make_reference(args, model, ranks)
    engine = start_engine(args, path, ranks)
    if engine:
        task.sample = engine.sample_groups  # Step 1 on the engine instead of sampler.py
    learner, sched = make_learner(args, model, ref, ranks)
    state = {"step": 0, "data_pos": 0, "samples": 0, "acc_before": None, "acc_after": None}
    if args.resume:
        state = resume_state(args, ckpt_path, model, learner, sched, ranks, state)
    if engine:
        engine.push(model)  # the weights the run starts from (a resumed checkpoint's)
    out = open_run_log(args, ranks, path, state) if ranks.master else None  # rank 0 writes OUT/
    return Setup(task, eval_rows, tokenizer, model, lora_config, ref, engine, learner, sched,
                 ckpt_path, out, meter), state


def load_data(args: flags.TrainArgs) -> tuple[data.Reward, list[dict], list[dict]]:
    """The --reward functions, the --data rows and the held-out --eval-data rows ([] without)."""
    reward_fn = data.Reward.load(args.reward, args.reward_weights)
    fields = args.prompt_field, args.answer_field
    train_rows = data.load_rows(args.data, "train", *fields, hf_split=args.data_split)
    eval_rows = data.load_rows(args.eval_data, "eval", *fields, args.eval_size, args.eval_split) \
        if args.eval_data else []
    return reward_fn, train_rows, eval_rows


def find_checkpoint(args: flags.TrainArgs) -> str:
    """OUT/checkpoint.pt (--fsdp: the folder OUT/checkpoint/); with --resume it must be there."""
    ckpt_path = os.path.join(args.out, "checkpoint" if args.fsdp else "checkpoint.pt")
    found = checkpoint.latest(ckpt_path) if args.fsdp else os.path.exists(ckpt_path)
    if args.resume and not found:
        raise data.InputError(f"--resume: no checkpoint at {ckpt_path}")
    return ckpt_path


def load_policy(args: flags.TrainArgs, ranks: parallel.Dist):
    """(folder, tokenizer, model, LoRA config or None): --model loaded (the built-in one built by
    rank 0 alone), --lora-r's adapters added, --gradient-checkpointing on, on the device."""
    if args.model == "builtin" and ranks.world > 1:  # rank 0 builds the cached base model once
        if ranks.master:
            builtin.base_model()
        ranks.barrier()
    path, tokenizer, model = checkpoint.load_model(args.model, args.trust_remote_code)
    lora_config = None
    if args.lora_r:
        lora_config = lora.add_adapters(model, args.lora_r, args.lora_alpha,
                                        args.lora_target_modules, path)
    if args.gradient_checkpointing:
        parallel.checkpoint_activations(model)
    if not args.fsdp:  # FSDP2 moves each layer's shards to the device as it wraps it
        model.to(ranks.device)
    return path, tokenizer, model, lora_config


def make_task(args: flags.TrainArgs, tokenizer, model, train_rows: list[dict],
              eval_rows: list[dict], reward_fn: data.Reward) -> Task:
    """The prompts' encoding (checked on every row now: messages need a chat template), the end
    ids and pad, the decoding of a response, the reward; Step 1 on sampler.py."""
    encode = data.PromptFormatter(tokenizer, args.prompt_template, args.system_prompt,
                                  args.chat_template)
    encode.check(train_rows, f"--data {args.data}")
    encode.check(eval_rows, f"--eval-data {args.eval_data}")
    eos = checkpoint.end_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    decode = lambda roll, i: tokenizer.decode(roll.response_ids[i, : roll.lengths[i]],  # noqa: E731
                                              skip_special_tokens=True)
    return Task(train_rows, encode, decode, reward_fn, eos, pad)


def make_reference(args: flags.TrainArgs, model, ranks: parallel.Dist):
    """The KL term's reference (beta > 0): a frozen copy (--fsdp: sharded), or with LoRA the model
    itself with its adapters off; None at beta 0."""
    if args.beta <= 0:
        return None
    if args.lora_r:
        return model
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if args.fsdp:
        parallel.shard(ref, ranks.device)
    return ref


def start_engine(args: flags.TrainArgs, path: str, ranks: parallel.Dist):
    """--rollout vllm: a colocated vLLM engine on this rank's device, loaded from `path`; else
    None."""
    if args.rollout != "vllm":
        return None
    return vllm_rollout.Engine(path, ranks.device, args.bf16, args.seed,
                               args.vllm_gpu_memory_utilization, args.max_num_seqs)


def make_learner(args: flags.TrainArgs, model, ref, ranks: parallel.Dist):
    """(update.Learner, the lr schedule): the policy wrapped for DDP or FSDP2, AdamW on its
    trainable parameters, --bf16's autocast, the linear --warmup-steps schedule."""
    device_type = torch.device(ranks.device).type
    amp = lambda: torch.autocast(device_type, torch.bfloat16, enabled=args.bf16)  # noqa: E731
    policy = parallel.wrap(model, ranks, args.fsdp)  # FSDP2 shards `model` in place: policy is it
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0  # noqa
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    as_reference = (lambda: lora.adapters_off(model)) if args.lora_r else contextlib.nullcontext
    return update.Learner(policy, model, ref, opt, amp, as_reference), sched


def resume_state(args: flags.TrainArgs, ckpt_path: str, model, learner: update.Learner, sched,
                 ranks: parallel.Dist, state: dict) -> dict:
    """--resume: model, optimizer, scheduler and RNG states read back; the counters of `state`
    (step, data position, samples, accuracies) as the checkpoint saved them."""
    if args.fsdp:
        ckpt = checkpoint.load_sharded(ckpt_path, model, learner.opt, sched, ranks)
    else:
        ckpt = checkpoint.load(ckpt_path, model, learner.opt, sched)
    return {k: ckpt[k] for k in state}


def open_run_log(args: flags.TrainArgs, ranks: parallel.Dist, path: str, state: dict):
    """Rank 0's metrics.RunLog: config.json (the resolved flags, the world size, the model's
    folder); a resumed run cuts its logs back to the checkpoint's step."""
    config = {**dataclasses.asdict(args), "world_size": ranks.world, "model_path": path}
    resumed_at = state["step"] if args.resume else None
    return metrics.RunLog(args, config, resumed_at)


if __name__ == "__main__":
    main()
