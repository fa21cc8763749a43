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

import builtin
import checkpoint
import curves
import dapo
import data
import evaluate
import flags
import grpo
import lora
import metrics
import parallel
import sampler
import update
import verifier
import vllm_rollout
from sampler import Rollout

USER_ERRORS = (data.InputError, checkpoint.CheckpointError, checkpoint.FolderInUse,
               parallel.ShardingError)  # one line, exit 2


# ---------------------------------------------------------------------------------------------
# The run
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


def draw_round(model, task: Task, args: flags.TrainArgs, ddp: parallel.Dist, first: int):
    """Steps 1 + 2 on this rank's block of the prompts first .. first + prompts_per_step - 1 of the
    stream. Returns the rollout with its Step 2 fields filled in (`correct`, `rewards`: DAPO's +-1
    and the soft overlong penalty, `index`, `reward_parts`), and its timings."""
    t0 = time.time()
    block = args.prompts_per_step // ddp.world
    mine = data.prompt_rows(task.rows, args.seed, first + ddp.rank * block, block)
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


def reward_std(roll: Rollout, ddp: parallel.Dist) -> float:
    """The std of all ranks' rewards of the step (--adv-scale batch), Bessel-corrected."""
    r = roll.rewards.double()                                                # [N]
    sums = torch.tensor([r.numel(), r.sum(), (r * r).sum()], dtype=torch.float64)
    n, s1, s2 = ddp.sum(sums).tolist()
    return math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1)) if n > 1 else 0.0


def main(argv=None) -> dict:
    args = flags.parse_train_args(argv, __doc__.split("\n\n")[0])
    ddp = parallel.Dist(args.device, args.fsdp)
    lock = None
    try:
        lock = checkpoint.lock_folder(args.out, ddp)  # rank 0 holds OUT/.lock for the whole run
        return run(args, ddp)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if lock is not None:
            lock.close()
        ddp.close()


def run(args: flags.TrainArgs, ddp: parallel.Dist) -> dict:
    # ---------------------------------------------------------------- setup
    if args.prompts_per_step % ddp.world:
        raise data.InputError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the "
                              f"{ddp.world} ranks")
    torch.manual_seed(args.seed)
    reward_fn = data.Reward.load(args.reward, args.reward_weights)
    fields = args.prompt_field, args.answer_field
    train_rows = data.load_rows(args.data, "train", *fields, hf_split=args.data_split)
    eval_rows = data.load_rows(args.eval_data, "eval", *fields, args.eval_size, args.eval_split) \
        if args.eval_data else []
    ckpt_path = os.path.join(args.out, "checkpoint" if args.fsdp else "checkpoint.pt")
    found = checkpoint.latest(ckpt_path) if args.fsdp else os.path.exists(ckpt_path)
    if args.resume and not found:
        raise data.InputError(f"--resume: no checkpoint at {ckpt_path}")
    if args.model == "builtin" and ddp.world > 1:  # rank 0 builds the cached base model once
        if ddp.master:
            builtin.base_model()
        ddp.barrier()
    path, tokenizer, model = checkpoint.load_model(args.model, args.trust_remote_code)
    lora_config = None
    if args.lora_r:
        lora_config = lora.add_adapters(model, args.lora_r, args.lora_alpha,
                                        args.lora_target_modules, path)
    if args.gradient_checkpointing:
        parallel.checkpoint_activations(model)
    if not args.fsdp:  # FSDP2 moves each layer's shards to the device as it wraps it
        model.to(ddp.device)
    encode = data.PromptFormatter(tokenizer, args.prompt_template, args.system_prompt,
                                  args.chat_template)
    encode.check(train_rows, f"--data {args.data}")  # messages need a chat template: say so now
    encode.check(eval_rows, f"--eval-data {args.eval_data}")
    eos = checkpoint.end_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    decode = lambda roll, i: tokenizer.decode(roll.response_ids[i, : roll.lengths[i]],  # noqa: E731
                                              skip_special_tokens=True)
    device_type = torch.device(ddp.device).type
    amp = lambda: torch.autocast(device_type, torch.bfloat16, enabled=args.bf16)  # noqa: E731
    ref = None  # the KL term's reference: a frozen copy, or with LoRA the model, adapters off
    if args.beta > 0:
        ref = model if args.lora_r else copy.deepcopy(model).eval().requires_grad_(False)
    engine = None
    if args.rollout == "vllm":
        engine = vllm_rollout.Engine(path, ddp.device, args.bf16, args.seed,
                                     args.vllm_gpu_memory_utilization, args.max_num_seqs)
    sample = engine.sample_groups if engine else None  # Step 1's sampler: None for sampler.py's
    if ref is not None and args.fsdp:
        parallel.shard(ref, ddp.device)
    policy = parallel.wrap(model, ddp, args.fsdp)  # FSDP2 shards `model` in place (policy is model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0  # noqa
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    as_reference = (lambda: lora.adapters_off(model)) if args.lora_r else contextlib.nullcontext
    learner = update.Learner(policy, model, ref, opt, amp, as_reference)
    state = {"step": 0, "data_pos": 0, "samples": 0, "acc_before": None, "acc_after": None}
    if args.resume:
        ckpt = checkpoint.load_sharded(ckpt_path, model, opt, sched, ddp) if args.fsdp else \
            checkpoint.load(ckpt_path, model, opt, sched)
        state = {k: ckpt[k] for k in state}
    if engine:
        engine.push(model)  # the weights the run starts from (a resumed checkpoint's)
    config = {**dataclasses.asdict(args), "world_size": ddp.world, "model_path": path}
    resumed_at = state["step"] if args.resume else None
    out = metrics.RunLog(args, config, resumed_at) if ddp.master else None  # rank 0 writes OUT/

    def evaluate_at(step: int) -> float | None:
        """Held-out metrics (evaluate.py; split over ranks) logged; returns accuracy, or mean@n."""
        if not eval_rows:
            return None
        with parallel.unsharded(None if engine else model):  # --fsdp: gathered once for all
            m, _ = evaluate.evaluate_model(model, tokenizer, eval_rows, args, ddp, reward_fn,
                                           sample)
        if out:
            out.log({"step": step, **m})
        return m[evaluate.headline(args.eval_samples)]

    task = Task(train_rows, encode, decode, reward_fn, eos, pad, sample)

    # ---------------------------------------------------------------- the loop
    t_start = time.time()
    if not args.resume:
        state["acc_before"] = state["acc_after"] = evaluate_at(0)
    steps = range(state["step"], args.steps)
    bar, signal = steps, metrics.SignalCheck(args)
    if ddp.master and len(steps):
        bar = tqdm(steps, desc=args.algo, initial=state["step"], total=args.steps,
                   dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # ---- Step 1 + 2: rollouts, rewards (DAPO: dynamic sampling, overlong punishment) ----
        def draw(rnd: int, start: int = state["data_pos"]) -> tuple[Rollout, dict[str, float]]:
            """Round rnd of this step: the prompts from the step's data position + rnd rounds on."""
            return draw_round(model, task, args, ddp, start + rnd * args.prompts_per_step)

        if args.dynamic_sampling:  # rounds: every (rollout, timings) drawn, kept or not
            roll, sstats, rounds = dapo.dynamic_sampling(draw, args.prompts_per_step,
                                                         args.max_rounds, ddp.gather, ddp.rank)
        else:
            rounds = [draw(0)]
            roll, sstats = rounds[0][0], {"sampling/rounds": 1.0}
        state["data_pos"] += int(sstats["sampling/rounds"]) * args.prompts_per_step

        # ---- Step 3: group advantages (and DAPO's overlong filtering of the loss mask) ----
        batch_std = reward_std(roll, ddp) if args.adv_scale == "batch" else None  # all ranks'
        rewards = roll.rewards.view(-1, args.group_size)                     # [B, G]
        advantages = grpo.group_advantages(rewards, args.adv_scale, batch_std=batch_std)  # [B, G]
        advantages = advantages.view(-1)                                     # [B*G]
        mask = roll.mask                                                     # [B*G, T]
        if args.overlong_filter:
            mask = dapo.overlong_filter(roll.mask, roll.truncated)

        # ---- Step 4: the clipped surrogate, --mini-batches optimizer updates (x --mu passes) ----
        if engine:
            engine.sleep()                           # CUDA: its memory is the update's until push
        stats = update.update_policy(learner, roll, advantages, mask, args, ddp)
        sched.step()                                 # the lr schedule counts rollout steps
        if engine:
            engine.push(model)                       # the updated weights, for what samples next

        # ---- metrics, summed over ranks ----
        d = ddp.sum_named(metrics.drawn_sums([r for r, _ in rounds]))
        state["samples"] += int(d["samples"])
        row = {"step": step + 1, **metrics.step_metrics(d, stats, args.mu, args.clip_c),
               "lr": sched.get_last_lr()[0], "samples": state["samples"], **sstats,
               "time/sample_s": sum(t["time/sample_s"] for _, t in rounds),
               "time/reward_s": sum(t["time/reward_s"] for _, t in rounds),
               "time/logprob_s": stats.logprob_s, "time/update_s": stats.update_s,
               "time/step_s": time.time() - t0}
        own_ref = None if ref is model else ref  # the bytes rank 0 holds (--fsdp: its shards)
        row["memory/state_bytes"] = parallel.state_bytes(model, opt, own_ref)
        if out:
            out.log(row)
            for warning in signal(row):  # no learning signal: once, in plain words
                tqdm.write(warning, file=sys.stderr)
            # a few of rank 0's completions of the batch trained on, to read what the policy writes
            out.completions(step + 1,
                            metrics.sampled_completions(roll, tokenizer, args.log_completions))
        state["step"] = step + 1
        done = state["step"] == args.steps or 0 < args.max_samples <= state["samples"]
        if state["step"] % args.eval_every == 0 or done:
            state["acc_after"] = evaluate_at(state["step"])
        if args.save_every and (state["step"] % args.save_every == 0 or done):
            if out:
                out.sync()  # the logs on disk up to this step before the checkpoint that says so
            if args.fsdp:   # every rank writes its shards
                checkpoint.save_sharded(ckpt_path, model, opt, sched, state, ddp)
            elif ddp.master:
                checkpoint.save(ckpt_path, model, opt, sched, state)
        if ddp.master and hasattr(bar, "set_postfix"):
            acc = state["acc_after"]
            bar.set_postfix(reward=f"{row['reward/correct']:.2f}", len=f"{row['len/mean']:.0f}",
                            **({"eval": f"{acc:.2f}"} if acc is not None else {}),
                            **({"signal": "none"} if signal.silent else {}))
        if done:
            break

    # ---------------------------------------------------------------- the end
    elapsed = time.time() - t_start
    # the whole model on rank 0 (FSDP2: gathered), LoRA's adapters merged
    weights = lora.merged_state_dict(model) if args.lora_r else parallel.full_state_dict(model)
    if engine:
        engine.close()
    if ddp.master:
        adapter = (lambda tmp: lora.save_adapter(model, lora_config, tmp)) if args.lora_r else None
        final = checkpoint.save_final(args.out, model, tokenizer, weights, adapter)
        out.close()
        what = "greedy accuracy" if args.eval_samples == 1 else f"mean@{args.eval_samples}"
        acc = ""
        if eval_rows and state["acc_before"] is not None:
            acc = (f"held-out {what} {state['acc_before']:.3f} -> {state['acc_after']:.3f} "
                   f"({len(eval_rows)} problems); ")
        print(f"{acc}{state['step']} steps, {state['samples']} samples in {elapsed:.0f}s; "
              f"model saved to {final}")
        if args.plot:
            png = os.path.join(args.out, "curves.png")
            if curves.plot_runs({args.algo: [metrics.read_metrics(out.metrics_path)]}, png):
                print(f"curves: {png}")
    return {"acc_before": state["acc_before"], "acc_after": state["acc_after"], "seconds": elapsed}


if __name__ == "__main__":
    main()
