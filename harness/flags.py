"""The command-line flags of train.py and evaluate.py, each defined once, with the papers' defaults.

Article section: the settings of "GRPO 训练过程拆解" and "DAPO：四项修正": --algo fills in either
paper's (ALGO_DEFAULTS: beta, the clip range, the loss reduction, dynamic sampling, the overlong
filter and penalty, the wrong answer's reward), --loss the clip range of variants.py's
objectives (LOSS_DEFAULTS); a flag given on the command line wins.

A flag is a dataclass field (`flag`: its default and help text); `add_flags` turns a flag dataclass
into argparse flags, in one group per `# -- title` section of its body. EvalArgs holds the flags
evaluation and sampling share (the model and data, how much, the run), EvalCli adds evaluate.py's,
TrainArgs train.py's; `resolve` fills in and checks the shared derived settings, `parse_train_args`
and `parse_eval_args` parse each command's flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from dataclasses import dataclass, field

import torch

import dapo
import variants
from harness import lora

# ---------------------------------------------------------------------------------------------
# Flags as dataclass fields, and argparse from them
# ---------------------------------------------------------------------------------------------

def flag(default, help, choices=None):  # noqa: A002 - a dataclass field, help for argparse
    return field(default=default, metadata={"help": help, "choices": choices})



@dataclass
class EvalArgs:
    """The flags evaluation and sampling share with train.py (TrainArgs, EvalCli inherit them)."""
    # -- the model and data
    model: str = flag("builtin", "'builtin' (a tiny model built and cached on first use), a HF hub "
                      "id or a local folder")
    prompt_field: str = flag("prompt", "field holding the prompt: a text, or a list of chat "
                             "messages (TRL's conversational format); a dotted path reaches a "
                             "nested field (GSM8K: question)")
    answer_field: str = flag("answer", "field holding the reference answer, or a dotted path "
                             "(DAPO-Math-17k: reward_model.ground_truth; GSM8K's '... #### 72' "
                             "works as is)")
    prompt_template: str = flag("{prompt}", "text sent as the user turn; {prompt} is replaced by "
                                "the row's prompt (a list of messages: the content of its last "
                                "user turn)")
    system_prompt: str | None = flag(None, "system message for chat models (prepended as a line "
                                     "without a chat template; a list of messages with a system "
                                     "turn of its own keeps that one)")
    chat_template: bool = flag(True, "apply the tokenizer's chat template when it has one "
                               "(--no-chat-template: raw text, an error for a list of messages)")
    reward: list[str] | None = flag(None, "'verifier' (the default), 'math-verify' (symbolic, "
                                    "optional: pip install math-verify) or module:function, "
                                    "f(response, answer) -> float or TRL's f(prompts, completions, "
                                    "**columns) -> list[float | None]; repeat to sum several")
    reward_weights: list[float] | None = flag(None, "one weight per --reward, the score being "
                                              "their weighted sum (default: all 1)")
    trust_remote_code: bool = flag(False, "let transformers run code shipped with the model (only "
                                   "for models you trust)")
    # -- how much
    max_new_tokens: int | None = flag(None, "longest response, L_max (default: 40 builtin, 1024 "
                                      "otherwise)")
    max_prompt_tokens: int = flag(0, "a longer prompt keeps its last N tokens (TRL's "
                                  "max_prompt_length; 0: no limit, the model's context is checked "
                                  "either way)")
    max_num_seqs: int | None = flag(None, "at most N sequences decode at once (vLLM's name; "
                                    "continuous batching): the built-in sampler's KV cache holds "
                                    "N x (P + T) positions, layers x KV heads x head_dim x 2 x "
                                    "bytes each (default: every row of the round at once; set it "
                                    "on a GPU, docs/memory.md); --rollout vllm: the engine's own, "
                                    "the flag caps it only when given")
    eval_size: int = flag(256, "held-out problems evaluated (the first eval_size rows)")
    eval_samples: int = flag(1, "n, responses sampled per held-out problem: 1 is greedy "
                             "(eval/accuracy); n > 1 logs mean@n, pass@k, maj@n")
    eval_temperature: float = flag(1.0, "sampling temperature of evaluation when --eval-samples > "
                                   "1 (DAPO: 1.0)")
    eval_top_p: float = flag(1.0, "nucleus sampling of evaluation when --eval-samples > 1 (DAPO: "
                             "0.7)")
    rollout: str = flag("hf", "rollout engine: hf (sampler.py, read beside the article) or vllm (a "
                        "colocated vLLM engine per rank, in evaluate.py one per model, "
                        "harness/vllm_rollout.py; needs vLLM installed)",
                        ["hf", "vllm"])
    vllm_gpu_memory_utilization: float | None = flag(
        None, "--rollout vllm: fraction of GPU memory the engine may take for its weights and KV "
        "cache (default: on CUDA what the trainer leaves while it samples, the GPU less the "
        "weights, AdamW and reference it keeps there and a 10%% margin, "
        "vllm_rollout.default_memory_utilization; on CPU 0.3 of host memory)")
    # -- the run
    seed: int = flag(0, "seeds the data order, the sampling and the model's initialisation "
                     "(evaluation: with the problem index)")
    device: str | None = flag(None, "cpu or cuda (default: cuda if available)")
    bf16: bool | None = flag(None, "bfloat16 autocast for every forward pass, weights and Adam "
                             "kept in float32 (default: on with CUDA)")
    fp32_lm_head: bool = flag(False, "under --bf16: the LM head's matmul and log-softmax in "
                              "float32, in the sampler, the trainer and the vLLM engine "
                              "(head_dtype), as MiniMax-M1 and ScaleRL (TRL's "
                              "cast_lm_head_to_fp32)")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, like every other bad input
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def sections(cls) -> tuple[dict[str, str], list[str]]:
    """The sections of a flag dataclass and its bases, as `# -- title` comment lines in each class
    body mark them: ({field name: the title of its section}, the titles in order). A class inserts
    the titles it adds after the section before them in its body (TrainArgs adds "optimisation"
    after EvalArgs' "how much")."""
    titles, order = {}, []
    for c in [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c)]:  # bases first
        title, at = None, 0
        for line in inspect.getsource(c).splitlines():
            if line.startswith("    # -- "):
                title = line.removeprefix("    # -- ").strip()
                if title in order:
                    at = order.index(title) + 1
                else:
                    order.insert(at, title)
                    at += 1
            elif title and (name := re.match(r"    (\w+):", line)):
                titles[name.group(1)] = title
    return titles, order


def add_flags(p: argparse.ArgumentParser, cls, **overrides) -> None:
    """One --flag per field of the dataclass `cls` (bools as --x/--no-x), in an argument group per
    section (`sections`); overrides: extra add_argument kwargs."""
    titles, order = sections(cls)
    groups = {t: p.add_argument_group(t) for t in order}
    for f in dataclasses.fields(cls):
        group = groups[titles[f.name]] if f.name in titles else p
        flag_ = "--" + f.name.replace("_", "-")
        kw = {"default": f.default, "help": f.metadata["help"]}
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        kind = kind.removesuffix(" | None")                                   # None: resolved later
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "list[str]":  # repeated flag: --reward a --reward b
            kw["action"] = "append"
        elif kind == "list[float]":  # one flag, several values: --reward-weights 1 0.5
            kw.update(nargs="+", type=float)
        else:
            kw["type"] = {"int": int, "float": float, "str": str}[kind]
            kw["choices"] = f.metadata["choices"]
        group.add_argument(flag_, **{**kw, **overrides.get(f.name, {})})


def resolve(ns, error, builtin: bool) -> None:
    """The shared derived settings, filled in place, and their checks (`error(message)` exits)."""
    if ns.max_new_tokens is None:
        ns.max_new_tokens = 40 if builtin else 1024
    if ns.device is None:
        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.bf16 is None:
        ns.bf16 = ns.device.startswith("cuda")
    if ns.reward is None:
        ns.reward = ["verifier"]
    checks = [  # (holds, the one-line error if not)
        (ns.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (ns.eval_size >= 1, "--eval-size must be >= 1"),
        (ns.max_prompt_tokens >= 0, "--max-prompt-tokens must be >= 0 (0: no limit)"),
        ("{prompt}" in ns.prompt_template, "--prompt-template needs {prompt}"),
        (ns.eval_samples >= 1, "--eval-samples must be >= 1"),
        (ns.eval_temperature > 0, "--eval-temperature must be > 0"),
        (0 < ns.eval_top_p <= 1, "--eval-top-p must be in (0, 1]"),
        (ns.vllm_gpu_memory_utilization is None or 0 < ns.vllm_gpu_memory_utilization <= 1,
         "--vllm-gpu-memory-utilization must be in (0, 1]"),
        (ns.max_num_seqs is None or ns.max_num_seqs >= ns.eval_samples,
         "--max-num-seqs must be >= --eval-samples (a problem's samples decode together)"),
        (ns.reward_weights is None or len(ns.reward_weights) == len(ns.reward),
         "--reward-weights needs one weight per --reward"),
    ]
    for ok, msg in checks:
        if not ok:
            error(msg)


# ---------------------------------------------------------------------------------------------
# evaluate.py's flags
# ---------------------------------------------------------------------------------------------

@dataclass
class EvalCli(EvalArgs):
    """evaluate.py's flags: EvalArgs' and these."""
    # -- the model and data
    data: str = flag("builtin", "'builtin' (the built-in held-out split), a JSONL (or .json) file "
                     "with a prompt and an answer per row, or through `datasets`: a Parquet/Arrow "
                     "file, a folder or a hub data set id")
    data_split: str = flag("test", "split of --data when it is a folder or a hub id (datasets)")
    # -- the run
    out: str | None = flag(None, "write one JSON line per model and problem here (prompt, "
                           "reference, samples with score and answer)")


def parse_eval_args(argv=None, description: str | None = None) -> EvalCli:
    """evaluate.py's flags from `argv` (default: sys.argv), one or more --model side by side, the
    shared derived settings filled in and checked (`resolve`); `description` heads --help."""
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, EvalCli, model={"nargs": "+", "default": ["builtin"],
                                 "help": "one or more models ('builtin', a HF hub id or a local "
                                         "folder), side by side"})
    ns = p.parse_args(argv)
    resolve(ns, p.error, builtin=ns.data == "builtin" or all(m == "builtin" for m in ns.model))
    return EvalCli(**vars(ns))


# ---------------------------------------------------------------------------------------------
# train.py's flags, and the papers' defaults
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainArgs(EvalArgs):
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
    steps: int | None = flag(None, "training steps, in all (default: builtin 30 with --algo dapo, "
                             "40 with grpo; 500 otherwise)")
    prompts_per_step: int | None = flag(None, "prompts (groups) per step, over all ranks (default: "
                                        "32 builtin, 512 otherwise)")
    group_size: int = flag(8, "G, responses sampled per prompt")
    temperature: float = flag(1.0, "sampling temperature of rollouts (evaluation: --eval-samples, "
                              "--eval-temperature)")
    top_p: float = flag(1.0, "nucleus sampling of rollouts; below 1 the trainer's log-probs are "
                             "under each token's nucleus (docs/rollout-correction.md)")
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
    micro_batch_size: int = flag(64, "at most this many responses per forward pass in the update "
                                 "and the no-grad log-prob passes")
    micro_batch_tokens: int = flag(8192, "and at most this many padded positions per pass (its "
                                   "responses x (longest prompt + longest response); verl's "
                                   "ppo_max_token_len_per_gpu); a longer response runs alone")
    dist_timeout_min: float = flag(60.0, "minutes a collective waits for the slowest rank before "
                                   "the run fails (torch's default is 10; one rank's 20k-token "
                                   "rollout can end minutes after another's)")
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
                     "cispo, dppo, sapo (variants.py)", ["ppo", "gspo", "cispo", "dppo", "sapo"])
    kl: str = flag("k3", "KL estimator of the beta term: k1, k2 (its gradient is KL's), k3 "
                   "(DeepSeekMath)", ["k1", "k2", "k3"])
    entropy_coef: float = flag(0.0, "subtract this times the mean token entropy from the loss (0: "
                               "off)")
    vllm_tensor_parallel_size: int = flag(1, "--rollout vllm: ranks per engine (vLLM's "
                                          "tensor_parallel_size): each group of this many "
                                          "consecutive ranks shares one engine, sharded across "
                                          "them, and samples the group's prompts together; "
                                          "must divide the number of ranks")
    tis_cap: float | None = flag(None, "rollout correction: the upper bound C on the ratio "
                                 "w = pi_old / pi_sampler that weights each token's surrogate "
                                 "(correction.py; 0: off; default: 2 with --rollout vllm, "
                                 "verl's token-level truncation, else 0)")
    is_level: str = flag("token", "rollout correction: the ratio per token, per sequence (the "
                         "product of its tokens', TRL's sequence modes) or their geometric mean",
                         ["token", "sequence", "geometric"])
    is_mode: str = flag("truncate", "rollout correction: truncate w to [--is-low, C] (TIS), mask "
                        "(w inside, 0 outside: TRL's *_mask, IcePop) or reject (1 inside, 0 "
                        "outside: verl's rejection sampling)", ["truncate", "mask", "reject"])
    is_low: float = flag(0.0, "rollout correction: the lower bound on w (IcePop's alpha 0.5; "
                         "0: none)")
    off_policy_mask: float = flag(0.0, "DeepSeek-V3.2's off-policy sequence mask: drop from the "
                                  "surrogate each response with a negative advantage whose mean "
                                  "log pi_sampler - log pi_theta over its tokens exceeds this "
                                  "(TRL's off_policy_mask_threshold; 0: off)")
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
    report_to: str = flag("none", "also send every metrics.jsonl row to wandb or tensorboard "
                          "(OUT/tensorboard/NAME) as it is written (rank 0), the run named after "
                          "the --out folder",
                          ["none", "wandb", "tensorboard"])
    log_completions: int = flag(2, "append this many sampled completions per step (prompt, "
                                "response, reward) to OUT/completions.jsonl (0: off)")
    peak_tflops: float | None = flag(None, "peak TFLOP/s of one device, what perf/mfu divides by "
                                     "(default: a known GPU's bf16 dense peak by name; CPU: a "
                                     "matmul probe at start)")


ALGO_DEFAULTS = {  # the papers' settings; a flag given on the command line wins
    "grpo": dict(beta=0.04, eps_low=0.2, eps_high=0.2, reduction="sequence", dynamic_sampling=False,
                 overlong_filter=False, overlong_penalty=False, wrong_reward=0.0),
    "dapo": dict(beta=0.0, eps_low=dapo.EPS_LOW, eps_high=dapo.EPS_HIGH, reduction="token",
                 dynamic_sampling=True, overlong_filter=True, overlong_penalty=True,
                 wrong_reward=-1.0),
}
LOSS_DEFAULTS = {  # the papers' clip ranges, over --algo's (a flag given on the command line wins)
    "gspo": dict(eps_low=variants.GSPO_EPS_LOW, eps_high=variants.GSPO_EPS_HIGH),
    "cispo": dict(eps_low=variants.CISPO_EPS_LOW, eps_high=variants.CISPO_EPS_HIGH),
    "dppo": dict(eps_low=variants.DPPO_DELTA, eps_high=variants.DPPO_DELTA),
}
BUILTIN_DEFAULTS = dict(steps=40, prompts_per_step=32, lr=2e-4)  # max_new_tokens...: resolve
# --algo dapo on the built-in task stops at 30 steps. A 30-step run is a 40-step run's first 30
# steps (the lr is constant), and its held-out accuracy at 30 is within noise of that at 40 (seeds
# 0-2: 0.973 / 0.973, 0.973 / 0.969, 0.969 / 0.984), while those last 10 steps, where most groups
# come out all right and dynamic sampling draws 4 rounds a step, take a third of the run
# (docs/speed.md, "The first run"). GRPO keeps 40: at 30 it drops more (0.973, 0.945, 0.965 vs
# 0.977, 0.961, 0.973), and its 40 steps take under a minute
BUILTIN_ALGO_DEFAULTS = {"dapo": dict(steps=30)}
MODEL_DEFAULTS = dict(steps=500, prompts_per_step=512, lr=1e-6)
MINIMUMS = dict(steps=0, prompts_per_step=1, mu=1, mini_batches=1, micro_batch_size=1,  # --x >= v
                micro_batch_tokens=1, dist_timeout_min=1e-3, vllm_tensor_parallel_size=1,
                max_rounds=1, eval_every=1, save_every=0, max_samples=0, log_completions=0)
LORA_LR_SCALE = 10.0  # --lora-r: the default learning rate times this
VLLM_TIS_CAP = 2.0  # --tis-cap's default with --rollout vllm (as TRL and verl)


def parse_train_args(argv=None, description: str | None = None) -> TrainArgs:
    """train.py's flags from `argv` (default: sys.argv), the settings left at None filled in
    (--algo's and --loss's papers, the built-in task's or a model's defaults) and checked; a bad
    one exits with one line and code 2. `description` heads --help (train.py's docstring)."""
    p = Parser(description=description,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, TrainArgs)
    ns = p.parse_args(argv)
    # --- derived settings: resolved once, here, and written to config.json ---
    fill = {**ALGO_DEFAULTS[ns.algo], **LOSS_DEFAULTS.get(ns.loss, {}),
            **({**BUILTIN_DEFAULTS, **BUILTIN_ALGO_DEFAULTS.get(ns.algo, {})}
               if ns.model == "builtin" else MODEL_DEFAULTS)}
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
    if ns.eval_data is None and ns.data == "builtin":
        ns.eval_data = "builtin"
    checks = [  # (holds, the one-line error if not)
        (ns.group_size >= 2,
         "--group-size must be >= 2 (advantages compare answers within a group)"),
        (ns.max_num_seqs is None or ns.max_num_seqs >= ns.group_size,
         "--max-num-seqs must be >= --group-size (a group's G responses decode together)"),
        (ns.vllm_tensor_parallel_size == 1 or ns.rollout == "vllm",
         "--vllm-tensor-parallel-size is for --rollout vllm"),
        *((getattr(ns, k) >= v, f"--{k.replace('_', '-')} must be >= {v}")
          for k, v in MINIMUMS.items()),
        (ns.clip_c == 0 or ns.clip_c > 1, "--clip-c must be 0 or > 1"),
        (ns.clip_c == 0 or ns.loss == "ppo", "--clip-c (dual-clip) is for --loss ppo only"),
        (ns.tis_cap >= 0, "--tis-cap must be >= 0 (0: off)"),
        (0 <= ns.is_low and (ns.tis_cap == 0 or ns.is_low < ns.tis_cap),
         "--is-low must be >= 0 and below --tis-cap"),
        (ns.tis_cap > 0 or (ns.is_level, ns.is_mode, ns.is_low) == ("token", "truncate", 0.0),
         "--is-level, --is-mode and --is-low shape the correction --tis-cap turns on"),
        (ns.off_policy_mask >= 0, "--off-policy-mask must be >= 0 (0: off)"),
        (ns.peak_tflops is None or ns.peak_tflops > 0, "--peak-tflops must be > 0"),
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
    ]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    return TrainArgs(**vars(ns))
