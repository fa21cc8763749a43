"""The built-in default: the article's task (linear equations such as 2x + 5 = 13) and a tiny model.

Article section: "GRPO 训练过程拆解" (the worked example: prompt "求解方程：2x + 5 = 13", G = 4).

Nothing is downloaded. On first use `base_model()` builds a character-level tokenizer and a ~0.86M
parameter Llama-config causal LM, warm-starts it with a supervised phase on worked solutions, saves
both with `save_pretrained` and returns the folder, which train.py then loads through
AutoModelForCausalLM / AutoTokenizer exactly as it loads a real model. The folder is cached under
`.cache/` next to this file, keyed by `recipe_key` (every setting below and the code that builds
it), so editing either rebuilds it.

The warm-start data imitates a sloppy solver, the way pretraining data mixes good and bad reasoning:
- careful solutions ("3x=13-5 / 3x=8 / ... / Answer: 4"), a fifth of them verbose, with a check line
  that does not fit the default --max-new-tokens (so some samples are truncated);
- a shortcut that ignores the constant and divides ("x=13/3 / Answer: 4"), usually wrong.
It solves one-sided equations carefully 80% of the time but two-sided ones only 35% of the time, so
the base model's greedy answer to a two-sided equation is usually the shortcut: held-out greedy
accuracy starts near 57% (0.570: 93% of one-sided equations, 22% of two-sided ones), and a
verifier's reward has a clear lesson to teach (work every equation out).
Every DAPO fix has something to act on: groups all right or all wrong (dynamic sampling), truncated
verbose answers (overlong filtering and punishment), long and short responses (token-level loss).

The warm start (1,200 steps of 64 demonstrations, ~2.9M tokens, each drawn once, packed into rows so
that a step pays for 1.07x its tokens instead of 1.8x padded: `warm_start_batches`, timed both ways
by `python -m bench --only warmstart`) takes minutes on a CPU, so its result ships in the
repository: `base_model/` holds the weights, the tokenizer and recipe.json, whose key is
`recipe_key` of the recipe that built them. `base_model()` returns that folder while the key matches
the code, and builds into the cache otherwise; a test fails while the shipped key is stale,
so a changed recipe cannot ship old weights.

Habit models for the experiments of `python -m ablate` (ablate/habits.py: `Habit`, `habit_model`):
a short fine-tune of the base model, keyed by `habit_key` and shipped the same way
(ablate/habit_models/, `python -m ablate.habits --ship`), else built into the cache on first use;
their code is outside the base recipe, so its key and the shipped weights stay as they are.

    # find (shipped or cached) or build the base model and print its folder
    python -m harness.builtin
    # build if needed and write it to base_model/ (after changing the recipe)
    python -m harness.builtin --ship
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import random
import shutil
import time
import zlib
from dataclasses import asdict, dataclass

import torch

CHARS = "0123456789+-*/=()x\n :Acehknrsw"  # every character the task's prompts and solutions use
SPECIALS = ["<pad>", "<eos>", "<unk>"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
CACHE_DIR = os.path.join(ROOT, ".cache")
# the shipped build
SHIP_DIR = os.path.join(ROOT, "base_model")
# what a build runs, see recipe_key
RECIPE_ROOTS = ("make_tokenizer", "make_model", "supervised_warm_start")


@dataclass(frozen=True)
class BaseModelConfig:
    """Everything that determines the built-in base model; its hash names the cache folder."""
    hidden_size: int = 128           # width of the Llama-config transformer
    num_layers: int = 4              # decoder layers
    num_heads: int = 4               # attention heads
    intermediate_size: int = 384     # MLP width
    sft_steps: int = 1200            # supervised warm-start steps, each on fresh demonstrations
    sft_batch_size: int = 64         # worked solutions per supervised step
    sft_pack_len: int = 128          # tokens per packed row of a supervised batch
    sft_lr: float = 3e-3             # AdamW learning rate of the warm start (cosine to 10%)
    sft_warmup: float = 0.04         # fraction of the steps that warm the learning rate up
    verbose_frac: float = 0.2        # fraction of careful solutions written in the verbose style
    # how often the demonstrations solve ax+b=c carefully (else the shortcut)
    careful_one_sided: float = 0.8
    careful_two_sided: float = 0.35  # how often they solve ax+b=cx+d carefully
    seed: int = 0                    # seeds the weights and the supervised data


# ---------------------------------------------------------------------------------------------
# The task: problems, worked solutions, and a deterministic held-out split
# ---------------------------------------------------------------------------------------------

def _signed(n: int) -> str:
    """'+5' or '-5', for a constant written after another term."""
    return f"+{n}" if n >= 0 else f"{n}"


def _x(coef: int) -> str:
    """'3x', or 'x' for a coefficient of 1."""
    return "x" if coef == 1 else f"{coef}x"


def make_problem(rng: random.Random) -> tuple[str, int]:
    """One equation with an integer solution, as (equation text, x): either ax+b=c or ax+b=cx+d."""
    x = rng.randint(-9, 9)
    b = rng.choice([n for n in range(-9, 10) if n != 0])
    if rng.random() < 0.5:
        a = rng.randint(2, 9)
        return f"{a}x{_signed(b)}={a * x + b}", x
    a = rng.randint(3, 9)
    c = rng.randint(1, a - 2)
    d = (a - c) * x + b  # so that x solves ax + b = cx + d
    return f"{a}x{_signed(b)}={_x(c)}{_signed(d)}", x


def solve_steps(equation: str, x: int, verbose: bool) -> str:
    """The careful worked solution of `equation` (as written by make_problem),
    ending in 'Answer: x'."""
    lhs, rhs = equation.split("=")
    a, b = (int(v) for v in _split_linear(lhs))
    lines = []
    if "x" in rhs:
        c, d = (int(v) for v in _split_linear(rhs))
        lines.append(f"{a}x-{_x(c)}={d}{_signed(-b)}")
        k, m = a - c, d - b
    else:
        k, m = a, int(rhs) - b
        lines.append(f"{a}x={rhs}{_signed(-b)}")
    lines.append(f"{k}x={m}")
    lines.append(f"x={m}/{k}")
    if verbose:
        lines.append(f"check: {equation.replace('x', f'({x})')}")
    lines.append(f"Answer: {x}")
    return "\n".join(lines)


def shortcut_steps(equation: str) -> str:
    """The sloppy solver's habit: ignore the constant next to x and divide,
    'ax+b=c' -> c/a (usually wrong)."""
    lhs, rhs = equation.split("=")
    a = int(_split_linear(lhs)[0])
    m = int(_split_linear(rhs)[1]) if "x" in rhs else int(rhs)
    return f"x={m}/{a}\nAnswer: {int(m / a)}"


def demonstration(equation: str, x: int, rng: random.Random, cfg: BaseModelConfig) -> str:
    """What the warm-start data shows for `equation`: careful on one-sided equations most of the
    time, on two-sided ones seldom; careful solutions are verbose (with a check line)
    a fraction of the time."""
    careful = cfg.careful_one_sided if "x" not in equation.split("=")[1] else cfg.careful_two_sided
    if rng.random() >= careful:
        return shortcut_steps(equation)
    return solve_steps(equation, x, verbose=rng.random() < cfg.verbose_frac)


def warm_start_demos(cfg: BaseModelConfig) -> list[tuple[str, str]]:
    """Every (prompt, solution) of the warm start, in order: cfg.sft_steps batches of
    cfg.sft_batch_size demonstrations (`demonstration`) of training problems, each drawn once."""
    rng = random.Random(cfg.seed + 1)
    demos = []
    while len(demos) < cfg.sft_steps * cfg.sft_batch_size:
        eq, x = make_problem(rng)
        if not is_heldout(eq):
            demos.append((prompt_text(eq), demonstration(eq, x, rng, cfg)))
    return demos


def _split_linear(side: str) -> tuple[str, str]:
    """'3x+5' -> ('3', '5'); 'x-4' -> ('1', '-4')."""
    coef, const = side.split("x")
    return (coef or "1"), (const or "0")


def prompt_text(equation: str) -> str:
    return equation + "\n"


def is_heldout(equation: str) -> bool:
    """A fixed eighth of all equations is held out for evaluation and never drawn for training."""
    return zlib.crc32(equation.encode()) % 8 == 0


def sample_problems(n: int, seed: int, heldout: bool, distinct: bool = True) -> list[dict]:
    """`n` problems from one split, as rows {"prompt", "answer"} (the JSONL format of --data).

    distinct=False draws from the task's distribution with repeats (a training stream);
    distinct=True gives n different problems (an evaluation set) and raises
    if the split has too few.
    """
    rng, rows, seen = random.Random(seed), [], set()
    for _ in range(200 * n):
        if len(rows) == n:
            break
        eq, x = make_problem(rng)
        if is_heldout(eq) == heldout and not (distinct and eq in seen):
            seen.add(eq)
            rows.append({"prompt": prompt_text(eq), "answer": str(x)})
    if len(rows) < n:
        raise ValueError(f"the {'held-out' if heldout else 'training'} split has fewer than {n} "
                         f"distinct problems")
    return rows


# ---------------------------------------------------------------------------------------------
# The tokenizer and the model
# ---------------------------------------------------------------------------------------------

def make_tokenizer():
    """A character-level fast tokenizer: one token per character,
    <eos> appended by the sampler's caller."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def make_model(cfg: BaseModelConfig, vocab_size: int):
    """A randomly initialised Llama-config causal LM (a llama config keeps the
    custom tokenizer intact)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config)


def warm_start_batches(tokenizer, cfg: BaseModelConfig
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every supervised batch, drawn once: (input_ids, position_ids, labels), each [R, L], packed.

    A batch is cfg.sft_batch_size demonstrations (prompt + worked solution + <eos>) of training
    problems, packed longest first into rows of at most cfg.sft_pack_len tokens (each into the first
    row with room), so a step pays for almost no padding (padded to its longest, a batch would pay
    ~1.8x its tokens). Positions restart at 0 with each demonstration: from that alone the Llama
    model builds a block-causal mask, so each demonstration is attended exactly as if it were alone
    (test_packed_warm_start_is_exact). Labels score the solution tokens only
    (-100 on prompts and padding).
    """
    demos = warm_start_demos(cfg)
    eos, pad, L = tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.sft_pack_len
    # character-level: a text's ids are its characters' ids; looked up directly, the 76,800
    # demonstrations take 0.6 s instead of 5.6 s through the tokenizer (the packed test checks both
    # give the same ids)
    vocab = tokenizer.get_vocab()
    # (tokens, prompt length)
    seqs = [([vocab[c] for c in p + r] + [eos], len(p)) for p, r in demos]
    longest = max(len(s) for s, _ in seqs)
    if longest > L:
        raise ValueError(f"sft_pack_len {L} is shorter than the longest demonstration ({longest} "
                         f"tokens)")
    batches = []
    for k in range(0, len(seqs), cfg.sft_batch_size):
        rows: list[list[tuple[list[int], int]]] = []
        fill: list[int] = []                                    # tokens in each row so far
        for s in sorted(seqs[k:k + cfg.sft_batch_size], key=lambda s: -len(s[0])):
            i = next((i for i, f in enumerate(fill) if f + len(s[0]) <= L), len(rows))
            if i == len(rows):
                rows.append([])
                fill.append(0)
            rows[i].append(s)
            fill[i] += len(s[0])
        T = max(fill)
        ids, pos, labels = [], [], []                           # row after row, [R * T]
        for row, f in zip(rows, fill):
            for s, p in row:
                ids += s
                pos += range(len(s))
                labels += [-100] * p + s[p:]
            ids += [pad] * (T - f)
            # the row's padding is one more block, never scored
            pos += range(T - f)
            labels += [-100] * (T - f)
        batches.append(tuple(torch.tensor(v).view(len(rows), T) for v in (ids, pos, labels)))
    return batches


def supervised_warm_start(model, tokenizer, cfg: BaseModelConfig, progress: bool = True) -> None:
    """Next-token cross-entropy on the solution tokens of the demonstrations, one pass over them."""
    import torch.nn.functional as F
    from tqdm import tqdm

    batches = warm_start_batches(tokenizer, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, round(cfg.sft_warmup * cfg.sft_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * s / cfg.sft_steps))))
    model.train()
    bar = tqdm(batches, desc="warm start (once)", disable=not progress, dynamic_ncols=True)
    for step, (ids, pos, labels) in enumerate(bar):
        logits = model(input_ids=ids, position_ids=pos,
                       use_cache=False).logits[:, :-1]  # [R, T-1, V]
        # mean over scored tokens
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


# ---------------------------------------------------------------------------------------------
# The recipe's key, the build, and the shipped copy
# ---------------------------------------------------------------------------------------------

def _canonical(node) -> str:
    """An AST as text without positions, docstrings and empty fields: comments, formatting and
    docstrings leave it unchanged, so does a Python version that adds an empty field;
    any change to the code does not."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(v) for v in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        documented = (isinstance(node, (ast.FunctionDef, ast.ClassDef))
                      and ast.get_docstring(node, clean=False) is not None)
        if name == "body" and documented:
            value = value[1:]
        if value is not None and value != []:
            fields.append(f"{name}={_canonical(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def recipe_code(source: str | None = None, roots: tuple[str, ...] = RECIPE_ROOTS) -> dict[str, str]:
    """The module-level definitions a build runs, canonical (`_canonical`): roots (RECIPE_ROOTS: the
    base model's) and every function, class and constant of this module they name, transitively (the
    task's generator, the demonstrations, the tokenizer's characters, the packing, the optimiser).
    source: this file's text (default: read it)."""
    if source is None:
        with open(os.path.abspath(__file__), encoding="utf-8") as fh:
            source = fh.read()
    defs = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            defs.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
    todo, code = list(roots), {}
    while todo:
        name = todo.pop()
        if name in code:
            continue
        code[name] = _canonical(defs[name])
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return code


def recipe_key(cfg: BaseModelConfig = BaseModelConfig(), source: str | None = None) -> str:
    """12 hex digits naming a build: a hash of cfg's fields and of recipe_code
    (what the build runs)."""
    recipe = {"config": asdict(cfg), "code": recipe_code(source)}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def shipped_key(ship_dir: str = SHIP_DIR) -> str | None:
    """The recipe key recorded in a shipped folder's recipe.json (None: no
    complete shipped folder)."""
    path = os.path.join(ship_dir, "recipe.json")
    if not os.path.exists(path) or not os.path.exists(os.path.join(ship_dir, "model.safetensors")):
        return None
    with open(path) as fh:
        return json.load(fh)["key"]


def base_model(cfg: BaseModelConfig = BaseModelConfig(), cache_dir: str = CACHE_DIR, log=print,
               ship_dir: str | None = SHIP_DIR) -> str:
    """The folder of the built-in base model: the shipped one if it was built by this recipe, else
    the cached build, built on first use (with a progress bar)."""
    key = recipe_key(cfg)
    if ship_dir is not None and shipped_key(ship_dir) == key:
        return ship_dir
    folder = os.path.join(cache_dir, f"base-{key}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    t0 = time.time()
    log(f"building the built-in base model in {folder} (once, a few minutes: no shipped build of "
        f"this recipe)", flush=True)
    tokenizer = make_tokenizer()
    model = make_model(cfg, len(tokenizer))
    supervised_warm_start(model, tokenizer, cfg)
    tmp = folder + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: a half-built folder never looks finished
    log(f"built in {time.time() - t0:.0f}s", flush=True)
    return folder


def ship(cfg: BaseModelConfig = BaseModelConfig(), cache_dir: str = CACHE_DIR,
         ship_dir: str = SHIP_DIR,
         log=print) -> str:
    """Write this recipe's build (found in the cache or built there) to
    ship_dir, with recipe.json."""
    key = recipe_key(cfg)
    if shipped_key(ship_dir) == key:
        log(f"{ship_dir} is already this recipe's build ({key})")
        return ship_dir
    built = base_model(cfg, cache_dir, log, ship_dir=None)
    write_shipped(built, ship_dir, {"key": key, "config": asdict(cfg)})
    log(f"shipped {built} to {ship_dir} (recipe {key})")
    return ship_dir


def write_shipped(built: str, dest: str, recipe: dict) -> None:
    """The model folder `built` copied to `dest` (replacing it whole) with its recipe.json: recipe
    and the torch and transformers versions that built it."""
    import transformers

    tmp = dest.rstrip(os.sep) + f".tmp{os.getpid()}"
    shutil.copytree(built, tmp)
    with open(os.path.join(tmp, "recipe.json"), "w") as fh:
        json.dump({**recipe, "torch": torch.__version__,
                   "transformers": transformers.__version__}, fh, indent=1)
        fh.write("\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


# The task's arithmetic under public names, for ablate/ and the tests (the recipe's code keeps its
# own names: recipe_key hashes them, so renaming would change the shipped weights' key)
split_linear = _split_linear
signed = _signed


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Find (shipped or cached) or build the built-in base "
                                            "model; print its folder.")
    p.add_argument("--ship", action="store_true",
                   help=f"write this recipe's build to {SHIP_DIR} (git add it then)")
    print(ship() if p.parse_args().ship else base_model())
