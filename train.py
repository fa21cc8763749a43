"""Online RL for language models with GRPO or DAPO: sample, verify, compute advantages, update.

Article section: the whole loop of "GRPO 训练过程拆解" (Step 1 rollouts -> Step 2 rewards -> Step 3
advantages -> Step 4 loss), with "DAPO：四项修正" switched on by --algo dapo.

    python train.py --algo dapo                      # built-in task and model, CPU, ~5 minutes
    python train.py --algo grpo --steps 60
    torchrun --standalone --nproc_per_node 8 train.py --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k.jsonl
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train.py ...

Distributed data parallel is wired through torchrun's environment variables and is invisible at world
size 1. Each rank samples a contiguous block of the step's prompts; a prompt's G samples stay on one rank.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import dapo
import grpo
from sampler import Rollout, sample_groups
from verifier import verify


def _f(default, help):  # noqa: A002 - a dataclass field whose help text argparse shows
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    algo: str = _f("dapo", "grpo or dapo: sets the papers' defaults for every field left at None below")
    model: str = _f("builtin", "'builtin' (a tiny model built and cached on first use), a HF hub id or a local folder")
    data: str = _f("builtin", "'builtin' (linear equations) or a JSONL file of {\"prompt\", \"answer\"} rows")
    eval_data: str = _f("builtin", "held-out JSONL for greedy evaluation; 'builtin' = the built-in held-out split")
    steps: int = _f(None, "training steps (default: 100 builtin, 500 otherwise)")
    prompts_per_step: int = _f(None, "prompts (groups) per step, over all ranks (default: 32 builtin, 512 otherwise)")
    group_size: int = _f(8, "G, responses sampled per prompt")
    max_new_tokens: int = _f(None, "longest response, L_max (default: 40 builtin, 1024 otherwise)")
    temperature: float = _f(1.0, "sampling temperature of rollouts (evaluation is greedy)")
    top_p: float = _f(1.0, "nucleus sampling of rollouts")
    lr: float = _f(None, "AdamW learning rate (default: 2e-4 builtin, 1e-6 otherwise, as in the papers)")
    warmup_steps: int = _f(0, "linear learning-rate warm-up steps (DAPO: 20)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    mu: int = _f(1, "policy updates per rollout batch; old log-probs are the sampling policy's")
    micro_batch_size: int = _f(64, "responses per forward pass in the update and the no-grad log-prob passes")
    beta: float = _f(None, "KL coefficient to the reference model, k3 estimator (grpo: 0.04, dapo: 0)")
    eps_low: float = _f(0.2, "lower clip range: ratio >= 1 - eps_low")
    eps_high: float = _f(None, "upper clip range, ratio <= 1 + eps_high (grpo: 0.2, dapo: 0.28 = clip-higher)")
    adv_scale: str = _f("group", "advantage scale: group (GRPO), batch, or none (Dr. GRPO)")
    reduction: str = _f(None, "loss reduction: sequence (grpo), token (dapo), constant (Dr. GRPO)")
    dynamic_sampling: bool = _f(None, "keep only groups with mixed rewards and resample to fill the step (dapo: on)")
    max_rounds: int = _f(4, "dynamic sampling: most sampling rounds per step before training on what it has")
    overlong_filter: bool = _f(None, "mask truncated responses out of the loss (dapo: on)")
    overlong_penalty: bool = _f(None, "soft overlong punishment, DAPO Eq. 13, added to the reward (dapo: on)")
    overlong_cache: int = _f(None, "L_cache of Eq. 13: the penalty ramps over the last L_cache tokens (default: L_max // 5)")
    eval_every: int = _f(20, "evaluate every this many steps (and before the first and after the last)")
    eval_size: int = _f(256, "held-out problems evaluated (the first eval_size rows of --eval-data)")
    seed: int = _f(0, "seeds the data order, the sampling and the model's initialisation")
    out: str = _f("runs/latest", "output folder: metrics.jsonl, config.json, final/")
    device: str = _f(None, "cpu or cuda (default: cuda if available)")


ALGO_DEFAULTS = {  # the papers' settings; a flag given on the command line wins
    "grpo": dict(beta=0.04, eps_high=0.2, reduction="sequence", dynamic_sampling=False,
                 overlong_filter=False, overlong_penalty=False),
    "dapo": dict(beta=0.0, eps_high=dapo.EPS_HIGH, reduction="token", dynamic_sampling=True,
                 overlong_filter=True, overlong_penalty=True),
}
BUILTIN_DEFAULTS = dict(steps=100, prompts_per_step=32, max_new_tokens=40, lr=2e-4)
MODEL_DEFAULTS = dict(steps=500, prompts_per_step=512, max_new_tokens=1024, lr=1e-6)


def parse_args(argv=None) -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    p.set_defaults(algo="dapo")
    ns = p.parse_args(argv)
    if ns.algo not in ALGO_DEFAULTS:
        p.error(f"--algo must be one of {sorted(ALGO_DEFAULTS)}")
    # --- derived settings: resolved once, here, and written to config.json ---
    fill = {**ALGO_DEFAULTS[ns.algo], **(BUILTIN_DEFAULTS if ns.model == "builtin" else MODEL_DEFAULTS)}
    for k, v in fill.items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    if ns.overlong_cache is None:
        ns.overlong_cache = max(1, ns.max_new_tokens // 5)
    if ns.device is None:
        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    checks = [(ns.group_size >= 2, "--group-size must be >= 2 (advantages compare answers within a group)"),
              (ns.max_new_tokens >= 1, "--max-new-tokens must be >= 1"), (ns.steps >= 0, "--steps must be >= 0"),
              (ns.prompts_per_step >= 1, "--prompts-per-step must be >= 1"), (ns.mu >= 1, "--mu must be >= 1"),
              (ns.micro_batch_size >= 1, "--micro-batch-size must be >= 1"), (ns.max_rounds >= 1, "--max-rounds must be >= 1"),
              (0 < ns.overlong_cache <= ns.max_new_tokens, "--overlong-cache must be in [1, max_new_tokens]"),
              (ns.adv_scale in ("group", "batch", "none"), "--adv-scale must be group, batch or none"),
              (ns.reduction in ("sequence", "token", "constant"), "--reduction must be sequence, token or constant"),
              (ns.eval_every >= 1, "--eval-every must be >= 1"), (ns.temperature > 0, "--temperature must be > 0")]
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
# Data and model loading
# ---------------------------------------------------------------------------------------------

def load_rows(path: str, split: str, n: int | None = None) -> list[dict]:
    if path == "builtin":
        import builtin
        return builtin.sample_problems(n or 20000, seed=1 if split == "train" else 2, heldout=split == "eval")
    rows = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                    raise ValueError(f"{path}:{i}: each row needs 'prompt' and 'answer'")
                rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"])})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows[:n] if n else rows


def prompt_rows(rows: list[dict], seed: int, start: int, count: int) -> list[tuple[int, dict]]:
    """Rows start..start+count-1 of the endless stream of epochs, each a fresh seeded shuffle of rows."""
    out, perms = [], {}
    for j in range(start, start + count):
        epoch = j // len(rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append((j, rows[int(perms[epoch][j % len(rows)])]))
    return out


def prompt_generator(seed: int, j: int) -> torch.Generator:
    """Sampling randomness of the j-th prompt of the run: a function of (seed, j) alone, never of the rank."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{j}".encode()))


def response_logprobs(model, roll: Rollout, rows: slice, temperature: float, with_entropy: bool = False):
    """log pi(response token) for rollout rows [n, T] (float32), optionally the entropy [n, T] too.

    One forward over left-padded prompt + right-padded response; only the last T + 1 positions' logits
    are materialised (logits_to_keep), and of those the T that predict the response.
    """
    prompts = [roll.prompts[i // roll.G] for i in range(rows.start, rows.stop)]
    resp, rmask = roll.response_ids[rows], roll.mask[rows]                   # [n, T]
    n, T = resp.shape
    P = max(len(p) for p in prompts)
    pids = torch.tensor([[roll.pad_token_id] * (P - len(p)) + p for p in prompts])           # [n, P]
    pmask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])               # [n, P]
    dev = next(model.parameters()).device
    ids = torch.cat([pids, resp.cpu()], 1).to(dev)                           # [n, P+T]
    attn = torch.cat([pmask, torch.ones(n, T, dtype=torch.long)], 1).to(dev)  # [n, P+T]; pads after EOS are masked by loss
    pos = (attn.cumsum(-1) - 1).clamp_min(0)                                  # [n, P+T]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=T + 1).logits[:, :-1]  # [n, T, V]
    logits = logits / temperature
    logp = grpo.token_logprobs(logits, resp.to(dev))                          # [n, T]
    ent = grpo.token_entropy(logits) if with_entropy else None                # [n, T]
    return logp, ent, rmask.to(dev)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    ddp = Dist(args.device)
    if args.prompts_per_step % ddp.world:
        sys.exit(f"error: --prompts-per-step {args.prompts_per_step} is not divisible by the {ddp.world} ranks")
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    if args.model == "builtin":
        import builtin
        if ddp.master:
            path = builtin.base_model()
        if ddp.world > 1:
            dist.barrier()
        path = builtin.base_model()
    else:
        path = args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(ddp.device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ref = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    policy = torch.nn.parallel.DistributedDataParallel(model) if ddp.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)
    train_rows = load_rows(args.data, "train")
    eval_rows = load_rows(args.eval_data, "eval", args.eval_size)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    decode = lambda roll, i: tokenizer.decode(roll.response_ids[i, : roll.lengths[i]], skip_special_tokens=True)  # noqa: E731

    metrics_file = None
    if ddp.master:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as fh:
            json.dump({**dataclasses.asdict(args), "world_size": ddp.world, "model_path": path}, fh, indent=1)
        metrics_file = open(os.path.join(args.out, "metrics.jsonl"), "w")

    def log(row: dict) -> None:
        if metrics_file:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()

    @torch.no_grad()
    def evaluate(step: int) -> float:
        """Greedy accuracy on the held-out rows; each rank takes every world-th row."""
        mine = eval_rows[ddp.rank::ddp.world]
        correct = trunc = length = 0.0
        for k in range(0, len(mine), 128):
            chunk = mine[k:k + 128]
            roll = sample_groups(model, [encode(r["prompt"]) for r in chunk], 1, args.max_new_tokens, eos, pad, temperature=0.0)
            correct += sum(verify(decode(roll, i), r["answer"]) for i, r in enumerate(chunk))
            trunc += roll.truncated.sum().item()
            length += roll.lengths.sum().item()
        c, t, L = ddp.sum(torch.tensor([correct, trunc, length])).tolist()
        n = len(eval_rows)
        log({"step": step, "eval/accuracy": c / n, "eval/truncated_frac": t / n, "eval/len_mean": L / n})
        return c / n

    t_start = time.time()
    acc_before = acc_after = evaluate(0)
    data_pos, samples_seen = 0, 0
    bar = range(args.steps)
    if ddp.master and args.steps:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{args.algo}", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # ---- Step 1 + 2: rollouts and rewards (DAPO: dynamic sampling, soft overlong punishment) ----
        drawn = torch.zeros(6)  # local sums: reward, correct, samples, length, truncated, zero-std groups
        timing = {"time/sample_s": 0.0, "time/reward_s": 0.0}

        def draw(rnd: int) -> Rollout:
            t_draw = time.time()
            block = args.prompts_per_step // ddp.world
            mine = prompt_rows(train_rows, args.seed, data_pos + rnd * args.prompts_per_step + ddp.rank * block, block)
            roll = sample_groups(model, [encode(r["prompt"]) for _, r in mine], args.group_size, args.max_new_tokens,
                                 eos, pad, args.temperature, args.top_p,
                                 generator=[prompt_generator(args.seed, j) for j, _ in mine])
            t_reward = time.time()
            timing["time/sample_s"] += t_reward - t_draw
            answers = [r["answer"] for _, r in mine for _ in range(args.group_size)]
            correct = torch.tensor([verify(decode(roll, i), a) for i, a in enumerate(answers)])  # [N]
            rewards = correct.clone()
            if args.overlong_penalty:
                rewards += dapo.overlong_penalty(roll.lengths.cpu(), args.max_new_tokens, args.overlong_cache)
            roll.extra = {"rewards": rewards, "correct": correct}
            timing["time/reward_s"] += time.time() - t_reward
            zero_std = (~dapo.keep_groups(rewards.view(-1, args.group_size))).sum()
            drawn.add_(torch.tensor([rewards.sum(), correct.sum(), len(answers), roll.lengths.sum().item(),
                                     roll.truncated.sum().item(), zero_std.item()], dtype=torch.float))
            return roll

        if args.dynamic_sampling:
            roll, sstats = dapo.dynamic_sampling(draw, args.prompts_per_step, args.max_rounds, ddp.gather, ddp.rank)
        else:
            roll, sstats = draw(0), {"sampling/rounds": 1.0}
        rounds = int(sstats["sampling/rounds"])
        data_pos += rounds * args.prompts_per_step

        # ---- Step 3: group advantages ----
        if roll is not None:
            rewards = roll.extra["rewards"].view(-1, args.group_size)                # [B, G]
            advantages = grpo.group_advantages(rewards, args.adv_scale).view(-1)    # [B*G]
            mask = dapo.overlong_filter(roll.mask, roll.truncated) if args.overlong_filter else roll.mask  # [B*G, T]
        n_local = 0 if roll is None else roll.response_ids.shape[0]
        num_tokens = ddp.sum(mask.sum() if roll is not None else torch.zeros(())).float()
        num_seqs = ddp.sum(torch.tensor(float(n_local))).float()
        mb = args.micro_batch_size
        n_micro = ddp.max(math.ceil(n_local / mb))  # every rank runs as many backward passes (DDP syncs in each)
        slices = [slice(k * mb, min((k + 1) * mb, n_local)) for k in range(n_micro)]

        # ---- no-grad passes: old policy (only when mu > 1) and reference (only when beta > 0) ----
        t_lp = time.time()
        with torch.no_grad():
            old_logp = [response_logprobs(model, roll, s, args.temperature)[0] for s in slices if s.start < s.stop] \
                if args.mu > 1 else None
            ref_logp = [response_logprobs(ref, roll, s, args.temperature)[0] for s in slices if s.start < s.stop] \
                if ref is not None else None

        # ---- Step 4: the clipped surrogate, mu updates over micro-batches ----
        t_update = time.time()
        timing["time/logprob_s"] = t_update - t_lp
        sums = torch.zeros(7)  # loss, kl*tok, entropy*tok, low*tok, high*tok, ratio*tok, tok
        grad_norm = 0.0
        for _epoch in range(args.mu):
            opt.zero_grad(set_to_none=True)
            for k, s in enumerate(slices):
                sync = ddp.world == 1 or k == len(slices) - 1
                with (policy.no_sync() if not sync else _null()):
                    if s.start >= s.stop:  # this rank has fewer micro-batches: a zero-weight pass keeps DDP in step
                        (policy(input_ids=torch.tensor([[pad]], device=ddp.device)).logits.sum() * 0.0).backward()
                        continue
                    logp, ent, m_full = response_logprobs(policy, roll, s, args.temperature, with_entropy=_epoch == 0)
                    old = old_logp[k] if old_logp is not None else logp.detach()
                    loss, m = grpo.policy_loss(
                        logp, old, advantages[s].to(logp.device), mask[s].to(logp.device), args.eps_low, args.eps_high,
                        ref_logp=ref_logp[k] if ref_logp is not None else None, beta=args.beta,
                        reduction=args.reduction, num_tokens=num_tokens, max_len=args.max_new_tokens, num_seqs=num_seqs)
                    (loss * ddp.world).backward()  # DDP averages gradients over ranks; the loss is already a global mean
                tok = float(mask[s].sum())
                ent_tok = float((ent * m_full).sum()) if ent is not None else 0.0
                sums += torch.tensor([loss.item(), m["kl"] * tok, ent_tok, m["clip/low_frac"] * tok,
                                      m["clip/high_frac"] * tok, m["ratio/mean"] * tok, tok])
            if args.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
            opt.step()
            sched.step()
        timing["time/update_s"] = time.time() - t_update

        # ---- metrics, reduced over ranks ----
        d = ddp.sum(drawn).tolist()
        u = ddp.sum(sums).tolist()
        ent_tokens = float(ddp.sum(torch.tensor(float(roll.mask.sum()) if roll is not None else 0.0)))
        samples_seen += int(d[2])
        tok = max(u[6], 1.0)
        row = {"step": step + 1, "loss": u[0] / args.mu, "reward/mean": d[0] / d[2], "reward/correct": d[1] / d[2],
               "reward/frac_zero_std": d[5] / (d[2] / args.group_size), "kl": u[1] / tok,
               "entropy": u[2] / max(ent_tokens, 1.0), "clip/low_frac": u[3] / tok, "clip/high_frac": u[4] / tok,
               "ratio/mean": u[5] / tok, "len/mean": d[3] / d[2], "len/truncated_frac": d[4] / d[2],
               "grad_norm": grad_norm, "lr": sched.get_last_lr()[0], "samples": samples_seen,
               **sstats, **timing, "time/step_s": time.time() - t0}
        log(row)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc_after = evaluate(step + 1)
        if ddp.master and hasattr(bar, "set_postfix"):
            bar.set_postfix(reward=f"{row['reward/correct']:.2f}", eval=f"{acc_after:.2f}", len=f"{row['len/mean']:.0f}")

    elapsed = time.time() - t_start
    if ddp.master:
        final = os.path.join(args.out, "final")
        tmp = final + ".tmp"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(final):
            import shutil
            shutil.rmtree(final)
        os.replace(tmp, final)
        metrics_file.close()
        print(f"held-out greedy accuracy {acc_before:.3f} -> {acc_after:.3f} ({len(eval_rows)} problems); "
              f"{args.steps} steps, {samples_seen} samples in {elapsed:.0f}s; model saved to {final}")
    if ddp.world > 1:
        dist.destroy_process_group()
    return {"acc_before": acc_before, "acc_after": acc_after, "seconds": elapsed}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
