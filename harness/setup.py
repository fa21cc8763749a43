"""The run's set-up: the data, the policy and its reference, the rollout engine, the optimizer, the
resume; and the session around it (torchrun's ranks, the output folder's lock, a user's error in one
line).

Not an article section: what train.py runs before its first step (train.run calls set_up), in the
order the seeded RNG is drawn in, so a resumed run and an unbroken one draw the same.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import sampler
import update
from harness import (
    builtin,
    checkpoint,
    data,
    flags,
    lora,
    metrics,
    models,
    perf,
    rollout,
    vllm_rollout,
)
from infra import lm_head, parallel
from infra.errors import USER_ERRORS, InputError


@contextlib.contextmanager
def session(args: flags.TrainArgs):
    """The ranks (parallel.Dist: torchrun's environment, or one process) for the run's body, with
    OUT/.lock held by rank 0 throughout; a user's error (errors.USER_ERRORS) is printed as one line
    and exits 2."""
    ranks = parallel.Dist(args.device, args.fsdp, args.dist_timeout_min)
    lock = None
    try:
        lock = checkpoint.lock_folder(args.out, ranks)  # rank 0 holds OUT/.lock for the whole run
        yield ranks
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if lock is not None:
            lock.close()
        ranks.close()


@dataclass
class Task:
    """What sampling and scoring need besides the policy: the prompts and how answers are read."""
    rows: list[dict]
    encode: Callable[[str | list[dict]], list[int]]  # prompt (text, messages) -> token ids
    decode: Callable[[sampler.Rollout, int], str]  # (rollout, row) -> response text
    reward_fn: data.Reward                      # (prompts, responses, rows) -> ([N], parts)
    eos: list[int]
    pad: int
    sample: Callable | None = None              # Step 1: None (sampler.py), or a vLLM engine's

    def prompt_rows(self, seed: int, start: int, count: int, stride: int = 1):
        """Items start, start + stride, ... (count of them) of the rows' endless seeded stream, as
        (position, row)."""
        return data.prompt_rows(self.rows, seed, start, count, stride)

    generator = staticmethod(data.prompt_generator)  # (seed, position) -> the prompt's generator


@dataclass
class RunState:
    """The run's counters, saved in every checkpoint and read back by --resume."""
    step: int = 0                      # steps done
    data_pos: int = 0                  # the stream position of the next step's first prompt
    samples: int = 0                   # responses sampled so far, all ranks
    acc_before: float | None = None    # held-out accuracy (or mean@n) before the first step
    acc_after: float | None = None     # ... after the last evaluation


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
    signal: metrics.SignalCheck         # the no-signal warnings' state (rank 0 feeds it rows)
    rounds_ahead: int = 1               # dynamic sampling's rounds drawn at once: the last step's


def set_up(args: flags.TrainArgs, ranks: parallel.Dist) -> tuple[Setup, RunState]:
    """Everything the loop needs, in this order (the order the seeded RNG is drawn in), and the
    run's counters: step, data position, samples, accuracy before and after (a resumed run's)."""
    if args.prompts_per_step % ranks.world:
        raise InputError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the "
                              f"{ranks.world} ranks")
    torch.manual_seed(args.seed)
    reward_fn, train_rows, eval_rows = load_data(args, ranks)
    ckpt_path = find_checkpoint(args)
    path, tokenizer, model, lora_config = load_policy(args, ranks)
    rollout.check_context(model, [[0]], args.max_new_tokens)   # before anything is built on it
    meter = perf.Meter.start(model, args, ranks)  # --peak-tflops, a GPU's by name, or a probe
    task = make_task(args, tokenizer, model, train_rows, eval_rows, reward_fn)
    ref = make_reference(args, model, ranks)
    # DDP's buckets and AdamW's state allocated before the engine takes its share of what is left
    learner, sched = make_learner(args, model, ref, ranks)
    engine = start_engine(args, path, model, ranks)
    if engine:
        task.sample = engine.sample_groups  # Step 1 on the engine instead of sampler.py
    state = (resume_state(args, ckpt_path, model, learner, sched, ranks) if args.resume
             else RunState())
    if engine:
        engine.push(model)  # the weights the run starts from (a resumed checkpoint's)
    out = open_run_log(args, ranks, path, state) if ranks.master else None  # rank 0 writes OUT/
    return Setup(task, eval_rows, tokenizer, model, lora_config, ref, engine, learner, sched,
                 ckpt_path, out, meter, metrics.SignalCheck(args)), state


def load_data(args: flags.TrainArgs, ranks: parallel.Dist
              ) -> tuple[data.Reward, list[dict], list[dict]]:
    """The --reward functions, the --data rows and the held-out --eval-data rows ([] without);
    repeated rows said by rank 0."""
    reward_fn = data.Reward.load(args.reward, args.reward_weights)
    fields = args.prompt_field, args.answer_field
    say = data.say_line if ranks.master else (lambda line: None)
    train_rows = data.load_rows(args.data, "train", *fields, hf_split=args.data_split, say=say)
    eval_rows = data.load_rows(args.eval_data, "eval", *fields, args.eval_size, args.eval_split,
                               say=say) if args.eval_data else []
    return reward_fn, train_rows, eval_rows


def find_checkpoint(args: flags.TrainArgs) -> str:
    """OUT/checkpoint.pt (--fsdp: the folder OUT/checkpoint/); with --resume it must be there."""
    ckpt_path = os.path.join(args.out, "checkpoint" if args.fsdp else "checkpoint.pt")
    found = checkpoint.latest(ckpt_path) if args.fsdp else os.path.exists(ckpt_path)
    if args.resume and not found:
        raise InputError(f"--resume: no checkpoint at {ckpt_path}")
    return ckpt_path


def load_policy(args: flags.TrainArgs, ranks: parallel.Dist):
    """(folder, tokenizer, model, LoRA config or None): --model loaded (the built-in one built by
    rank 0 alone), --lora-r's adapters added, --gradient-checkpointing on, on the device."""
    if args.model == "builtin" and ranks.world > 1:  # rank 0 builds the cached base model once
        if ranks.master:
            builtin.base_model()
        ranks.barrier()
    path, tokenizer, model = models.load_model(args.model, args.trust_remote_code)
    if args.fp32_lm_head:
        lm_head.run_in_fp32(model)                    # before the reference copy: it keeps it
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
                                  args.chat_template, args.max_prompt_tokens)
    encode.check(train_rows, f"--data {args.data}")
    encode.check(eval_rows, f"--eval-data {args.eval_data}")
    eos = models.end_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    decode = lambda roll, i: roll.response_text(i, tokenizer)  # noqa: E731
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


def start_engine(args: flags.TrainArgs, path: str, model, ranks: parallel.Dist):
    """--rollout vllm: a colocated vLLM engine on this rank's device, loaded from `path`; else
    None."""
    if args.rollout != "vllm":
        return None
    resident = vllm_rollout.trainer_resident_bytes(
        model, ranks.world if args.fsdp else 1, reference=args.beta > 0 and not args.lora_r,
        ddp=ranks.world > 1 and not args.fsdp)
    return vllm_rollout.engine_for(path, model, args, ranks.device, resident,
                                   args.vllm_tensor_parallel_size)


def make_learner(args: flags.TrainArgs, model, ref, ranks: parallel.Dist):
    """(update.Learner, the lr schedule): the policy wrapped for DDP or FSDP2, AdamW on its
    trainable parameters (fused on the CPU) with its state allocated (allocate_state), --bf16's
    autocast, the linear --warmup-steps schedule."""
    device_type = torch.device(ranks.device).type
    amp = lambda: torch.autocast(device_type, torch.bfloat16, enabled=args.bf16)  # noqa: E731
    policy = parallel.wrap(model, ranks, args.fsdp)  # FSDP2 shards `model` in place: policy is it
    trained = [p for p in model.parameters() if p.requires_grad]
    # on the CPU torch's default AdamW loops over the parameters one op at a time; its fused kernel
    # took a fifth of the time (SmolLM2-135M: 97 vs 508 ms a step, 2 cores). CUDA keeps the default
    # (foreach), the form the GPU memory model counts
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay,
                            fused=True if device_type == "cpu" else None)
    allocate_state(opt)
    warmup = lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0  # noqa
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    as_reference = (lambda: lora.adapters_off(model)) if args.lora_r else contextlib.nullcontext
    return update.Learner(policy, model, ref, opt, amp, as_reference), sched


def allocate_state(opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's state now (AdamW's two moments and step count, in the dtype, device and
    layout the optimizer itself picks), not lazily inside the first update: set-up then holds what
    the run holds, before a vLLM engine sizes its share of the GPU from what is left. One step with
    zero gradients at lr 0 (the moments stay 0, no weight moves, weight decay included), then
    the step counts back to 0, so the first real step is the one a fresh optimizer takes."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if opt.state or not params:
        return
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
        opt.state[p]["step"].zero_()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def resume_state(args: flags.TrainArgs, ckpt_path: str, model, learner: update.Learner, sched,
                 ranks: parallel.Dist) -> RunState:
    """--resume: model, optimizer, scheduler and RNG states read back; the run's counters
    (step, data position, samples, accuracies) as the checkpoint saved them."""
    if args.fsdp:
        ckpt = checkpoint.load_sharded(ckpt_path, model, learner.opt, sched, ranks)
    else:
        ckpt = checkpoint.load(ckpt_path, model, learner.opt, sched)
    saved_world = ckpt.get("world_size", ranks.world)
    if saved_world != ranks.world and ranks.master:
        print(f"note: the checkpoint was saved by {saved_world} ranks, resumed on {ranks.world}: "
              f"the same run up to reduction order (data, sampling and denominators do not depend "
              f"on the rank count; a --reward drawing from a global RNG draws other numbers)",
              file=sys.stderr)
    return RunState(**{f.name: ckpt[f.name] for f in dataclasses.fields(RunState)})


def open_run_log(args: flags.TrainArgs, ranks: parallel.Dist, path: str, state: RunState):
    """Rank 0's metrics.RunLog: config.json (the resolved flags, the world size, the model's
    folder); a resumed run cuts its logs back to the checkpoint's step."""
    config = {**dataclasses.asdict(args), "world_size": ranks.world, "model_path": path}
    resumed_at = state.step if args.resume else None
    return metrics.RunLog(args, config, resumed_at)

