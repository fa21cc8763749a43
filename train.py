"""Online RL for language models with GRPO or DAPO: sample, verify, compute advantages, update.

Article section: the whole loop of "GRPO 训练过程拆解" (Step 1 rollouts -> Step 2 rewards -> Step 3
advantages -> Step 4 loss), with "DAPO：四项修正" switched on by --algo dapo.

    python train.py --algo dapo                      # built-in task and model, CPU, ~5 minutes
    python train.py --algo grpo --steps 60
    torchrun --standalone --nproc_per_node 8 train.py --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k.jsonl
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train.py ...

Distributed data parallel is wired through torchrun's environment variables and is invisible at world
size 1. Each rank samples a contiguous block of the step's prompts; a prompt's G samples stay on one rank.
With --save-every K a checkpoint (model, optimizer, scheduler, RNG, step, data position) is written
atomically to OUT/checkpoint.pt; --resume continues from it with the same result as an unbroken run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# DDP's constructor imports torch.distributed.nn, whose functions take group.WORLD as a default argument.
# Imported after init_process_group, those defaults pin the process group, so destroy_process_group cannot
# free it and its gloo threads run on into interpreter exit (where a rank aborted in CI). Imported here,
# before any process group exists, the defaults are None. (Inside a function, `import torch.distributed.nn`
# would also make `torch` a local name there: pyflakes F823.)
import torch.distributed.nn  # noqa: F401

import builtin
import checkpoint
import dapo
import data
import evaluate
import grpo
import verifier
from evaluate import flag as _f
from evaluate import shared
from sampler import Rollout, rollout_logprobs, sample_groups


@dataclass
class Args:  # the flags evaluation shares with evaluate.py (same names and meanings) are defined there: shared(name)
    # -- what to train on
    algo: str = _f("dapo", "sets the papers' defaults for every field left at None below", ["grpo", "dapo"])
    model: str = shared("model")
    data: str = _f("builtin", "'builtin' (linear equations) or a JSONL file with a prompt and an answer per row")
    eval_data: str = _f(None, "held-out JSONL for evaluation (default: the built-in held-out split with "
                              "--data builtin, else no evaluation)")
    prompt_field: str = shared("prompt_field")
    answer_field: str = shared("answer_field")
    prompt_template: str = shared("prompt_template")
    system_prompt: str = shared("system_prompt")
    chat_template: bool = shared("chat_template")
    reward: str = shared("reward")
    format_weight: float = _f(0.0, "add this times verifier.format_reward (a final answer is stated) to each reward")
    trust_remote_code: bool = shared("trust_remote_code")
    # -- how much
    steps: int = _f(None, "training steps, in all (default: 40 builtin, 500 otherwise)")
    prompts_per_step: int = _f(None, "prompts (groups) per step, over all ranks (default: 32 builtin, 512 otherwise)")
    group_size: int = _f(8, "G, responses sampled per prompt")
    max_new_tokens: int = shared("max_new_tokens")
    temperature: float = _f(1.0, "sampling temperature of rollouts (evaluation: --eval-samples, --eval-temperature)")
    top_p: float = _f(1.0, "nucleus sampling of rollouts")
    eval_every: int = _f(20, "evaluate every this many steps (and before the first and after the last)")
    eval_size: int = shared("eval_size")
    eval_samples: int = shared("eval_samples")
    eval_temperature: float = shared("eval_temperature")
    eval_top_p: float = shared("eval_top_p")
    max_samples: int = _f(0, "also stop once this many responses were sampled (0: no limit); equal-budget comparisons")
    # -- optimisation
    lr: float = _f(None, "AdamW learning rate (default: 2e-4 builtin, 1e-6 otherwise, as in the papers)")
    warmup_steps: int = _f(0, "linear learning-rate warm-up steps (DAPO: 20)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    mu: int = _f(1, "policy updates per rollout batch; old log-probs are the sampling policy's")
    micro_batch_size: int = _f(64, "responses per forward pass in the update and the no-grad log-prob passes")
    bf16: bool = shared("bf16")
    # -- the loss: GRPO's settings, and DAPO's four fixes one by one
    beta: float = _f(None, "KL coefficient to the reference model, k3 estimator (grpo: 0.04, dapo: 0)")
    eps_low: float = _f(0.2, "lower clip range: ratio >= 1 - eps_low")
    eps_high: float = _f(None, "upper clip range, ratio <= 1 + eps_high (grpo: 0.2, dapo: 0.28 = clip-higher)")
    adv_scale: str = _f("group", "advantage scale: group (GRPO), batch, or none (Dr. GRPO)", ["group", "batch", "none"])
    reduction: str = _f(None, "loss reduction: sequence (grpo), token (dapo), constant (Dr. GRPO)",
                        ["sequence", "token", "constant"])
    dynamic_sampling: bool = _f(None, "keep only groups with mixed rewards and resample to fill the step (dapo: on)")
    max_rounds: int = _f(4, "dynamic sampling: most sampling rounds per step before training on what it has")
    overlong_filter: bool = _f(None, "mask truncated responses out of the loss (dapo: on)")
    overlong_penalty: bool = _f(None, "soft overlong punishment, DAPO Eq. 13, added to the reward (dapo: on)")
    overlong_cache: int = _f(None, "L_cache of Eq. 13: the penalty ramps over the last L_cache tokens (default: L_max // 5)")
    # -- the run
    seed: int = shared("seed")
    out: str = _f("runs/latest", "output folder: metrics.jsonl, config.json, checkpoint.pt, final/")
    save_every: int = _f(0, "write OUT/checkpoint.pt every this many steps (0: only the final model)")
    resume: bool = _f(False, "continue from OUT/checkpoint.pt (same flags; --steps is the total)")
    device: str = shared("device")
    plot: bool = _f(False, "draw OUT/curves.png (accuracy, entropy, length, truncation; needs matplotlib)")
    log_completions: int = _f(2, "append this many sampled completions per step (prompt, response, reward) to "
                                 "OUT/completions.jsonl (0: off)")


ALGO_DEFAULTS = {  # the papers' settings; a flag given on the command line wins
    "grpo": dict(beta=0.04, eps_high=0.2, reduction="sequence", dynamic_sampling=False,
                 overlong_filter=False, overlong_penalty=False),
    "dapo": dict(beta=0.0, eps_high=dapo.EPS_HIGH, reduction="token", dynamic_sampling=True,
                 overlong_filter=True, overlong_penalty=True),
}
BUILTIN_DEFAULTS = dict(steps=40, prompts_per_step=32, lr=2e-4)     # max_new_tokens, device, bf16: evaluate.resolve
MODEL_DEFAULTS = dict(steps=500, prompts_per_step=512, lr=1e-6)


def parse_args(argv=None) -> Args:
    p = evaluate.Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    evaluate.add_flags(p, Args)
    ns = p.parse_args(argv)
    # --- derived settings: resolved once, here, and written to config.json ---
    fill = {**ALGO_DEFAULTS[ns.algo], **(BUILTIN_DEFAULTS if ns.model == "builtin" else MODEL_DEFAULTS)}
    for k, v in fill.items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    evaluate.resolve(ns, p.error, builtin=ns.model == "builtin")  # the settings shared with evaluate.py, and their checks
    if ns.overlong_cache is None:
        ns.overlong_cache = max(1, ns.max_new_tokens // 5)
    if ns.eval_data is None and ns.data == "builtin":
        ns.eval_data = "builtin"
    checks = [(ns.group_size >= 2, "--group-size must be >= 2 (advantages compare answers within a group)"),
              (ns.steps >= 0, "--steps must be >= 0"),
              (ns.prompts_per_step >= 1, "--prompts-per-step must be >= 1"), (ns.mu >= 1, "--mu must be >= 1"),
              (ns.micro_batch_size >= 1, "--micro-batch-size must be >= 1"), (ns.max_rounds >= 1, "--max-rounds must be >= 1"),
              (0 < ns.overlong_cache <= ns.max_new_tokens, "--overlong-cache must be in [1, max_new_tokens]"),
              (ns.eval_every >= 1, "--eval-every must be >= 1"), (ns.temperature > 0, "--temperature must be > 0"),
              (0 < ns.top_p <= 1, "--top-p must be in (0, 1]"), (ns.save_every >= 0, "--save-every must be >= 0"),
              (ns.max_samples >= 0, "--max-samples must be >= 0"), (ns.log_completions >= 0, "--log-completions must be >= 0")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    return Args(**vars(ns))


# ---------------------------------------------------------------------------------------------
# Distributed: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them this is a single process
# ---------------------------------------------------------------------------------------------

class Dist:
    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.master = self.rank == 0
        self.device = device
        if self.world > 1:
            if device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduced sum (a float64 copy, on the collective's device)."""
        x = x.detach().to(self.device, torch.float64).clone()
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def max(self, n: int) -> int:
        """All-reduced maximum of an integer."""
        x = torch.tensor([n], device=self.device)
        if self.world > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return int(x.item())

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's equal-sized x, in rank order (bool travels as uint8: not every backend has bool)."""
        if self.world == 1:
            return [x]
        y = x.to(self.device, torch.uint8 if x.dtype == torch.bool else x.dtype)
        out = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(out, y)
        return [o.to("cpu", x.dtype) for o in out]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def update_policy(policy, model, ref, roll: Rollout, advantages, mask, args: Args, ddp: Dist, opt, sched, amp):
    """Step 4: --mu updates of the clipped surrogate over micro-batches; returns (metric sums, grad norm, s).

    Denominators are the step's global token and response counts, so the summed micro-batch gradients
    equal the full-batch gradient on any number of ranks. Every rank runs the same number of backward
    passes (a zero-weight one where it has run out), because DDP synchronises in each.
    """
    n_local = 0 if roll is None else roll.response_ids.shape[0]
    num_tokens = ddp.sum(mask.sum() if roll is not None else torch.zeros(())).float()
    num_seqs = ddp.sum(torch.tensor(float(n_local))).float()
    mb = args.micro_batch_size
    slices = [slice(k * mb, min((k + 1) * mb, n_local)) for k in range(ddp.max(math.ceil(n_local / mb)))]
    t0 = time.time()
    with torch.no_grad(), amp():  # old policy only when mu > 1 (else old = current), reference only when beta > 0
        old_logp = [rollout_logprobs(model, roll, s, args.temperature)[0] for s in slices if s.start < s.stop] \
            if args.mu > 1 else None
        ref_logp = [rollout_logprobs(ref, roll, s, args.temperature)[0] for s in slices if s.start < s.stop] \
            if ref is not None else None
    t_logprob = time.time() - t0
    sums = torch.zeros(8)  # loss, kl*tok, entropy*tok, low*tok, high*tok, ratio*tok, tok, entropy tokens
    grad_norm = 0.0
    for epoch in range(args.mu):
        opt.zero_grad(set_to_none=True)
        for k, s in enumerate(slices):
            last = k == len(slices) - 1
            with (policy.no_sync() if ddp.world > 1 and not last else contextlib.nullcontext()), amp():
                if s.start >= s.stop:  # this rank ran out of micro-batches: a zero-weight pass keeps DDP in step
                    (policy(input_ids=torch.zeros(1, 1, dtype=torch.long, device=ddp.device)).logits.sum() * 0.0).backward()
                    continue
                logp, ent, valid = rollout_logprobs(policy, roll, s, args.temperature, with_entropy=epoch == 0)
                loss, m = grpo.policy_loss(
                    logp, old_logp[k] if old_logp is not None else logp.detach(), advantages[s].to(logp.device),
                    mask[s].to(logp.device), args.eps_low, args.eps_high,
                    ref_logp=ref_logp[k] if ref_logp is not None else None, beta=args.beta,
                    reduction=args.reduction, num_tokens=num_tokens, max_len=args.max_new_tokens, num_seqs=num_seqs)
                (loss * ddp.world).backward()  # DDP averages gradients over ranks; the loss is already a global mean
            tok = float(mask[s].sum())
            ent_sum, ent_tok = (float((ent * valid).sum()), float(valid.sum())) if ent is not None else (0.0, 0.0)
            sums += torch.tensor([loss.item(), m["kl"] * tok, ent_sum, m["clip/low_frac"] * tok,
                                  m["clip/high_frac"] * tok, m["ratio/mean"] * tok, tok, ent_tok])
        if args.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        opt.step()
        sched.step()
    return sums, grad_norm, t_logprob


def main(argv=None) -> dict:
    args = parse_args(argv)
    ddp = Dist(args.device)
    try:
        return run(args, ddp)
    except data.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if ddp.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(args: Args, ddp: Dist) -> dict:
    # ---------------------------------------------------------------- setup
    if args.prompts_per_step % ddp.world:
        raise data.InputError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {ddp.world} ranks")
    torch.manual_seed(args.seed)
    reward_fn = verifier.load_reward(args.reward)
    train_rows = data.load_rows(args.data, "train", args.prompt_field, args.answer_field)
    eval_rows = data.load_rows(args.eval_data, "eval", args.prompt_field, args.answer_field, args.eval_size) \
        if args.eval_data else []
    ckpt_path, metrics_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "metrics.jsonl")
    completions_path = os.path.join(args.out, "completions.jsonl")
    if args.resume and not os.path.exists(ckpt_path):
        raise data.InputError(f"--resume: no checkpoint at {ckpt_path}")
    if args.model == "builtin" and ddp.world > 1:  # rank 0 builds the cached base model once, the others wait
        if ddp.master:
            builtin.base_model()
        dist.barrier()
    path, tokenizer, model = data.load_model(args.model, args.trust_remote_code)
    model.to(ddp.device)
    encode = data.PromptFormatter(tokenizer, args.prompt_template, args.system_prompt, args.chat_template)
    eos = data.end_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    decode = lambda roll, i: tokenizer.decode(roll.response_ids[i, : roll.lengths[i]], skip_special_tokens=True)  # noqa: E731
    amp = lambda: torch.autocast(torch.device(ddp.device).type, torch.bfloat16, enabled=args.bf16)  # noqa: E731
    ref = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    policy = torch.nn.parallel.DistributedDataParallel(model) if ddp.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)
    state = {"step": 0, "data_pos": 0, "samples": 0, "acc_before": None, "acc_after": None}
    if args.resume:
        ckpt = checkpoint.load(ckpt_path, model, opt, sched)
        state = {k: ckpt[k] for k in state}
    if ddp.master:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as fh:
            json.dump({**dataclasses.asdict(args), "world_size": ddp.world, "model_path": path}, fh, indent=1)
        if args.resume:
            checkpoint.trim_metrics(metrics_path, state["step"])
            checkpoint.trim_metrics(completions_path, state["step"])
    metrics_file = open(metrics_path, "a" if args.resume else "w") if ddp.master else None
    completions_file = open(completions_path, "a" if args.resume else "w") \
        if ddp.master and args.log_completions else None

    def log(row: dict) -> None:
        if metrics_file:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()

    def evaluate_at(step: int) -> float | None:
        """Held-out metrics (evaluate.py; split over ranks) logged; returns greedy accuracy, or mean@n."""
        if not eval_rows:
            return None
        m, _ = evaluate.evaluate_model(model, tokenizer, eval_rows, args, ddp, reward_fn)
        log({"step": step, **m})
        return m[evaluate.headline(args.eval_samples)]

    # ---------------------------------------------------------------- the loop
    t_start = time.time()
    if not args.resume:
        state["acc_before"] = state["acc_after"] = evaluate_at(0)
    steps = range(state["step"], args.steps)
    bar = steps
    if ddp.master and len(steps):
        from tqdm import tqdm
        bar = tqdm(steps, desc=args.algo, initial=state["step"], total=args.steps, dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # ---- Step 1 + 2: rollouts and rewards (DAPO: dynamic sampling, soft overlong punishment) ----
        drawn = torch.zeros(6)  # local sums: reward, correct, samples, length, truncated, zero-std groups
        timing = {"time/sample_s": 0.0, "time/reward_s": 0.0}

        def draw(rnd: int, drawn=drawn, timing=timing) -> Rollout:  # called within this step only
            t_draw = time.time()
            block = args.prompts_per_step // ddp.world
            first = state["data_pos"] + rnd * args.prompts_per_step + ddp.rank * block
            mine = data.prompt_rows(train_rows, args.seed, first, block)
            with amp():
                roll = sample_groups(model, [encode(r["prompt"]) for _, r in mine], args.group_size, args.max_new_tokens,
                                     eos, pad, args.temperature, args.top_p,
                                     generator=[data.prompt_generator(args.seed, j) for j, _ in mine])
            t_reward = time.time()
            timing["time/sample_s"] += t_reward - t_draw
            answers = [r["answer"] for _, r in mine for _ in range(args.group_size)]
            texts = [decode(roll, i) for i in range(len(answers))]
            correct = torch.tensor([float(reward_fn(t, a)) for t, a in zip(texts, answers)])              # [N]
            rewards = correct.clone()                                                                     # [N]
            if args.format_weight:
                rewards += args.format_weight * torch.tensor([verifier.format_reward(t) for t in texts])
            if args.overlong_penalty:
                rewards += dapo.overlong_penalty(roll.lengths.cpu(), args.max_new_tokens, args.overlong_cache)
            roll.extra = {"rewards": rewards}
            timing["time/reward_s"] += time.time() - t_reward
            zero_std = grpo.constant_groups(rewards.view(-1, args.group_size)).sum()
            drawn.add_(torch.tensor([rewards.sum(), correct.sum(), len(answers), roll.lengths.sum().item(),
                                     roll.truncated.sum().item(), zero_std.item()], dtype=torch.float))
            return roll

        if args.dynamic_sampling:
            roll, sstats = dapo.dynamic_sampling(draw, args.prompts_per_step, args.max_rounds, ddp.gather, ddp.rank)
        else:
            roll, sstats = draw(0), {"sampling/rounds": 1.0}
        state["data_pos"] += int(sstats["sampling/rounds"]) * args.prompts_per_step

        # ---- Step 3: group advantages (and DAPO's overlong filtering of the loss mask) ----
        advantages = mask = batch_std = None
        if args.adv_scale == "batch":               # the std of all ranks' rewards: N ranks scale as one rank does
            r = roll.extra["rewards"].double() if roll is not None else torch.zeros(0, dtype=torch.float64)
            n, s1, s2 = ddp.sum(torch.tensor([r.numel(), r.sum(), (r * r).sum()], dtype=torch.float64)).tolist()
            batch_std = math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1)) if n > 1 else 0.0
        if roll is not None:
            rewards = roll.extra["rewards"].view(-1, args.group_size)                # [B, G]
            advantages = grpo.group_advantages(rewards, args.adv_scale, batch_std=batch_std).view(-1)  # [B*G]
            mask = dapo.overlong_filter(roll.mask, roll.truncated) if args.overlong_filter else roll.mask  # [B*G, T]

        # ---- Step 4: the clipped surrogate ----
        t_update = time.time()
        sums, grad_norm, timing["time/logprob_s"] = update_policy(policy, model, ref, roll, advantages, mask, args, ddp,
                                                                   opt, sched, amp)
        timing["time/update_s"] = time.time() - t_update - timing["time/logprob_s"]

        # ---- metrics, reduced over ranks ----
        d = ddp.sum(drawn).tolist()
        u = ddp.sum(sums).tolist()
        state["samples"] += int(d[2])
        tok = max(u[6], 1.0)
        row = {"step": step + 1, "loss": u[0] / args.mu, "reward/mean": d[0] / d[2], "reward/correct": d[1] / d[2],
               "reward/frac_zero_std": d[5] / (d[2] / args.group_size), "kl": u[1] / tok,
               "entropy": u[2] / max(u[7], 1.0), "clip/low_frac": u[3] / tok, "clip/high_frac": u[4] / tok,
               "ratio/mean": u[5] / tok, "len/mean": d[3] / d[2], "len/truncated_frac": d[4] / d[2],
               "grad_norm": grad_norm, "lr": sched.get_last_lr()[0], "samples": state["samples"],
               **sstats, **timing, "time/step_s": time.time() - t0}
        log(row)
        if completions_file:  # a few of rank 0's completions of the batch trained on, to read what the policy writes
            completions_file.writelines(json.dumps({"step": step + 1, **c}) + "\n"
                                        for c in evaluate.sampled_completions(roll, tokenizer, args.log_completions))
            completions_file.flush()
        state["step"] = step + 1
        done = state["step"] == args.steps or 0 < args.max_samples <= state["samples"]
        if state["step"] % args.eval_every == 0 or done:
            state["acc_after"] = evaluate_at(state["step"])
        if args.save_every and (state["step"] % args.save_every == 0 or done) and ddp.master:
            checkpoint.save(ckpt_path, model, opt, sched, state)
        if ddp.master and hasattr(bar, "set_postfix"):
            bar.set_postfix(reward=f"{row['reward/correct']:.2f}", len=f"{row['len/mean']:.0f}",
                            **({"eval": f"{state['acc_after']:.2f}"} if state["acc_after"] is not None else {}))
        if done:
            break

    # ---------------------------------------------------------------- the end
    elapsed = time.time() - t_start
    if ddp.master:
        final = os.path.join(args.out, "final")
        tmp = f"{final}.tmp{os.getpid()}"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(final):
            import shutil
            shutil.rmtree(final)
        os.replace(tmp, final)
        metrics_file.close()
        if completions_file:
            completions_file.close()
        what = "greedy accuracy" if args.eval_samples == 1 else f"mean@{args.eval_samples}"
        acc = (f"held-out {what} {state['acc_before']:.3f} -> {state['acc_after']:.3f} ({len(eval_rows)} problems); "
               if eval_rows and state["acc_before"] is not None else "")
        print(f"{acc}{state['step']} steps, {state['samples']} samples in {elapsed:.0f}s; model saved to {final}")
        if args.plot:
            import ablate
            if ablate.plot_runs({args.algo: [ablate.read_metrics(metrics_path)]}, os.path.join(args.out, "curves.png")):
                print(f"curves: {os.path.join(args.out, 'curves.png')}")
    return {"acc_before": state["acc_before"], "acc_after": state["acc_after"], "seconds": elapsed}


if __name__ == "__main__":
    main()
