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

import argparse
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
import grpo
import lora
import parallel
import update
import variants
import verifier
import vllm_rollout
from evaluate import EvalArgs, Parser, add_flags, flag, resolve
from sampler import Rollout


@dataclass
class Args(EvalArgs):
    """train.py's flags: EvalArgs' (the model, data, sampling and evaluation flags) and these."""
    # -- the model and data
    algo: str = flag("dapo", "sets the papers' defaults for every field left at None below",
                     ["grpo", "dapo"])
    data: str = flag("builtin", "'builtin' (linear equations), a JSONL (or .json) file with a "
                     "prompt and an answer per row, or through `datasets`: a Parquet/Arrow file, a "
                     "folder or a hub data set id")
    data_split: str = flag("train", "split of --data when it is a folder or a hub id (datasets)")
    eval_data: str | None = flag(None, "held-out data for evaluation, as --data (default: the "
                                 "built-in held-out split with --data builtin, else no evaluation)")
    eval_split: str = flag("test", "split of --eval-data when it is a folder or a hub id "
                           "(datasets)")
    wrong_reward: float | None = flag(None, "reward of a wrong answer, a right one scoring 1: "
                                      "reward = w + (1 - w) * score (grpo: 0, the article; dapo: "
                                      "-1, the paper's +-1)")
    format_weight: float = flag(0.0, "add this times verifier.format_reward (a final answer is "
                                "stated) to each reward")
    # -- how much
    steps: int | None = flag(None, "training steps, in all (default: 40 builtin, 500 otherwise)")
    prompts_per_step: int | None = flag(None, "prompts (groups) per step, over all ranks (default: "
                                        "32 builtin, 512 otherwise)")
    group_size: int = flag(8, "G, responses sampled per prompt")
    temperature: float = flag(1.0, "sampling temperature of rollouts (evaluation: --eval-samples, "
                              "--eval-temperature)")
    top_p: float = flag(1.0, "nucleus sampling of rollouts")
    rollout: str = flag("hf", "rollout engine: hf (sampler.py, read beside the article) or vllm (a "
                        "colocated vLLM engine per rank, vllm_rollout.py; needs vLLM installed)",
                        ["hf", "vllm"])
    vllm_gpu_memory_utilization: float = flag(0.3, "--rollout vllm: fraction of GPU memory the "
                                              "engine may take (on CPU: of host memory)")
    eval_every: int = flag(20, "evaluate every this many steps (and before the first and after the "
                           "last)")
    max_samples: int = flag(0, "also stop once this many responses were sampled (0: no limit); "
                            "equal-budget comparisons")
    # -- optimisation
    lr: float | None = flag(None, "AdamW learning rate (default: 2e-4 builtin, 1e-6 otherwise, as "
                            "in the papers)")
    warmup_steps: int = flag(0, "linear learning-rate warm-up steps (DAPO: 20)")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    grad_clip: float = flag(1.0, "clip the global gradient norm to this (0: off)")
    mini_batches: int = flag(1, "optimizer updates per rollout step, each on 1/K of the step's "
                             "groups (DAPO paper: 16)")
    mu: int = flag(1, "passes over the step's mini-batches; old log-probs are the sampling "
                   "policy's")
    micro_batch_size: int = flag(64, "responses per forward pass in the update and the no-grad "
                                 "log-prob passes")
    fsdp: bool = flag(False, "shard weights, gradients, AdamW state and the reference model over "
                      "the ranks (FSDP2) instead of DDP")
    gradient_checkpointing: bool = flag(False, "recompute each layer's activations in backward "
                                        "(less memory on long responses)")
    lora_r: int = flag(0, "LoRA rank (peft): train only adapters of --lora-target-modules; the KL "
                       "reference is the model with them off; OUT/final is merged, OUT/adapter the "
                       "adapter alone (0: full fine-tuning)")
    lora_alpha: float | None = flag(None, "LoRA alpha: each adapted weight is W + alpha / r * B A "
                                    "(default: 2 * r)")
    lora_target_modules: str = flag(lora.TARGETS, "modules given adapters: comma-separated names "
                                    "(default: the attention and MLP projections of Llama, Qwen, "
                                    "Mistral) or all-linear")
    # -- the loss: GRPO's settings, and DAPO's four fixes one by one
    beta: float | None = flag(None, "KL coefficient to the reference model, estimator --kl (grpo: "
                              "0.04, dapo: 0)")
    eps_low: float | None = flag(None, "lower clip range: ratio >= 1 - eps_low (ppo: 0.2, gspo: "
                                 "3e-4, cispo: 1 = none)")
    eps_high: float | None = flag(None, "upper clip range, ratio <= 1 + eps_high (grpo: 0.2, dapo: "
                                  "0.28 = clip-higher; gspo: 4e-4, cispo: 4)")
    clip_c: float = flag(0.0, "dual-clip bound for negative advantages, loss <= -clip_c * A (0: "
                         "off; verl 3, DAPO recipe 10)")
    loss: str = flag("ppo", "objective: ppo (the clipped surrogate of GRPO/DAPO), gspo, "
                     "gspo-token, cispo (variants.py)", ["ppo", "gspo", "gspo-token", "cispo"])
    kl: str = flag("k3", "KL estimator of the beta term: k1, k2 (its gradient is KL's), k3 "
                   "(DeepSeekMath)", ["k1", "k2", "k3"])
    entropy_coef: float = flag(0.0, "subtract this times the mean token entropy from the loss (0: "
                               "off)")
    tis_cap: float | None = flag(None, "truncated importance sampling: each token's loss times "
                                 "min(pi_old / pi_sampler, C) (0: off; default: 2 with --rollout "
                                 "vllm, as TRL and verl, else 0)")
    adv_scale: str = flag("group", "advantage scale: group (GRPO), batch, or none (Dr. GRPO)",
                          ["group", "batch", "none"])
    reduction: str | None = flag(None, "loss reduction: sequence (grpo), token (dapo), constant "
                                 "(Dr. GRPO)", ["sequence", "token", "constant"])
    dynamic_sampling: bool | None = flag(None, "keep only groups with 0 < #correct < G (Eq. 11), "
                                         "resampling to fill the step (dapo: on)")
    max_rounds: int = flag(4, "dynamic sampling: most sampling rounds per step before training on "
                           "what it has")
    overlong_filter: bool | None = flag(None, "mask truncated responses out of the loss (dapo: on)")
    overlong_penalty: bool | None = flag(None, "soft overlong punishment, DAPO Eq. 13, added to "
                                         "the reward (dapo: on)")
    overlong_cache: int | None = flag(None, "L_cache of Eq. 13: the penalty ramps over the last "
                                      "L_cache tokens (default: L_max // 5)")
    # -- the run
    out: str = flag("runs/latest", "output folder: metrics.jsonl, config.json, checkpoint.pt "
                    "(--fsdp: checkpoint/), final/")
    save_every: int = flag(0, "write OUT/checkpoint.pt (--fsdp: OUT/checkpoint/) every this many "
                           "steps (0: only the final model)")
    resume: bool = flag(False, "continue from OUT/checkpoint.pt or OUT/checkpoint/ (same flags; "
                        "--steps is the total)")
    plot: bool = flag(False, "draw OUT/curves.png (accuracy, entropy, length, truncation; needs "
                      "matplotlib)")
    report_to: str = flag("none", "also send every metrics.jsonl row to wandb or tensorboard "
                          "(OUT/tensorboard/RUN_NAME) as it is written (rank 0)",
                          ["none", "wandb", "tensorboard"])
    run_name: str | None = flag(None, "the run's name for --report-to (default: the name of the "
                                "--out folder)")
    log_completions: int = flag(2, "append this many sampled completions per step (prompt, "
                                "response, reward) to OUT/completions.jsonl (0: off)")


ALGO_DEFAULTS = {  # the papers' settings; a flag given on the command line wins
    "grpo": dict(beta=0.04, eps_low=0.2, eps_high=0.2, reduction="sequence", dynamic_sampling=False,
                 overlong_filter=False, overlong_penalty=False, wrong_reward=0.0),
    "dapo": dict(beta=0.0, eps_low=dapo.EPS_LOW, eps_high=dapo.EPS_HIGH, reduction="token",
                 dynamic_sampling=True, overlong_filter=True, overlong_penalty=True,
                 wrong_reward=-1.0),
}
LOSS_DEFAULTS = {  # the papers' clip ranges, over --algo's (a flag given on the command line wins)
    "gspo": dict(eps_low=variants.GSPO_EPS_LOW, eps_high=variants.GSPO_EPS_HIGH),
    "gspo-token": dict(eps_low=variants.GSPO_EPS_LOW, eps_high=variants.GSPO_EPS_HIGH),
    "cispo": dict(eps_low=variants.CISPO_EPS_LOW, eps_high=variants.CISPO_EPS_HIGH),
}
BUILTIN_DEFAULTS = dict(steps=40, prompts_per_step=32, lr=2e-4)  # max_new_tokens...: resolve
MODEL_DEFAULTS = dict(steps=500, prompts_per_step=512, lr=1e-6)
MINIMUMS = dict(steps=0, prompts_per_step=1, mu=1, mini_batches=1, micro_batch_size=1,  # --x >= v
                max_rounds=1, eval_every=1, save_every=0, max_samples=0, log_completions=0)
LORA_LR_SCALE = 10.0  # --lora-r: the default learning rate times this
VLLM_TIS_CAP = 2.0  # --tis-cap's default with --rollout vllm (as TRL and verl)
USER_ERRORS = (data.InputError, checkpoint.CheckpointError, checkpoint.FolderInUse,
               parallel.ShardingError)  # one line, exit 2


def parse_args(argv=None) -> Args:
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, Args)
    ns = p.parse_args(argv)
    # --- derived settings: resolved once, here, and written to config.json ---
    fill = {**ALGO_DEFAULTS[ns.algo], **LOSS_DEFAULTS.get(ns.loss, {}),
            **(BUILTIN_DEFAULTS if ns.model == "builtin" else MODEL_DEFAULTS)}
    if ns.lora_r:  # LoRA's best lr: about 10x full fine-tuning's ("LoRA Without Regret", 2025)
        fill["lr"] *= LORA_LR_SCALE
    for k, v in fill.items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    if ns.tis_cap is None:  # an engine's log-probs differ from the trainer's: correct by default
        ns.tis_cap = VLLM_TIS_CAP if ns.rollout == "vllm" else 0.0
    resolve(ns, p.error, builtin=ns.model == "builtin")  # EvalArgs' settings, and their checks
    if ns.overlong_cache is None:
        ns.overlong_cache = max(1, ns.max_new_tokens // 5)
    if ns.lora_alpha is None:
        ns.lora_alpha = 2.0 * ns.lora_r
    if ns.run_name is None:
        ns.run_name = os.path.basename(os.path.abspath(ns.out))
    if ns.eval_data is None and ns.data == "builtin":
        ns.eval_data = "builtin"
    checks = [  # (holds, the one-line error if not)
        (ns.group_size >= 2,
         "--group-size must be >= 2 (advantages compare answers within a group)"),
        (ns.max_num_seqs is None or ns.max_num_seqs >= ns.group_size,
         "--max-num-seqs must be >= --group-size (a group's G responses decode together)"),
        *((getattr(ns, k) >= v, f"--{k.replace('_', '-')} must be >= {v}")
          for k, v in MINIMUMS.items()),
        (ns.clip_c == 0 or ns.clip_c > 1, "--clip-c must be 0 or > 1"),
        (ns.clip_c == 0 or ns.loss == "ppo", "--clip-c (dual-clip) is for --loss ppo only"),
        (ns.tis_cap >= 0, "--tis-cap must be >= 0 (0: off)"),
        (ns.beta >= 0, "--beta must be >= 0 (0: no KL term, no reference model)"),
        (ns.wrong_reward < 1, "--wrong-reward must be < 1 (a right answer scores 1)"),
        (0 < ns.overlong_cache <= ns.max_new_tokens,
         "--overlong-cache must be in [1, max_new_tokens]"),
        (ns.temperature > 0, "--temperature must be > 0"),
        (0 < ns.top_p <= 1, "--top-p must be in (0, 1]"),
        (ns.lora_r >= 0, "--lora-r must be >= 0 (0: full fine-tuning)"),
        (ns.lora_alpha > 0 or not ns.lora_r, "--lora-alpha must be > 0"),
        (not (ns.lora_r and ns.fsdp),
         "--lora-r with --fsdp is not supported (the adapters' state is small: use DDP)"),
        (0 < ns.vllm_gpu_memory_utilization <= 1,
         "--vllm-gpu-memory-utilization must be in (0, 1]"),
        (not (ns.lora_r and ns.rollout == "vllm"),
         "--lora-r with --rollout vllm is not supported yet (the engine takes plain weights: merge "
         "the adapters, or use --rollout hf)"),
    ]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    return Args(**vars(ns))


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


def draw_round(model, task: Task, args: Args, ddp: parallel.Dist, first: int):
    """Steps 1 + 2 on this rank's block of the prompts first .. first + prompts_per_step - 1 of the
    stream. Returns the rollout with its Step 2 fields filled in (`correct`, `rewards`: DAPO's +-1
    and the soft overlong penalty, `index`, `reward_parts`), and its timings."""
    t0 = time.time()
    block = args.prompts_per_step // ddp.world
    mine = data.prompt_rows(task.rows, args.seed, first + ddp.rank * block, block)
    prompts = [task.encode(r["prompt"]) for _, r in mine]
    generators = [data.prompt_generator(args.seed, j) for j, _ in mine]      # one per prompt
    with parallel.unsharded(None if task.sample else model):  # an engine holds its own weights
        roll = evaluate.sample_rollout(model, prompts, args.group_size, args.temperature,
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
    args = parse_args(argv)
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


def run(args: Args, ddp: parallel.Dist) -> dict:
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
    path, tokenizer, model = data.load_model(args.model, args.trust_remote_code)
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
    eos = data.end_ids(tokenizer, model)
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
    out = curves.RunLog(args, config, resumed_at) if ddp.master else None  # rank 0 writes OUT/

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
    bar, signal = steps, curves.SignalCheck(args)
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
        d = ddp.sum_named(curves.drawn_sums([r for r, _ in rounds]))
        state["samples"] += int(d["samples"])
        row = {"step": step + 1, **curves.step_metrics(d, stats, args.mu, args.clip_c),
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
                            evaluate.sampled_completions(roll, tokenizer, args.log_completions))
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
            if curves.plot_runs({args.algo: [curves.read_metrics(out.metrics_path)]}, png):
                print(f"curves: {png}")
    return {"acc_before": state["acc_before"], "acc_after": state["acc_after"], "seconds": elapsed}


if __name__ == "__main__":
    main()
