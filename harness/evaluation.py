"""Evaluation's library: the estimators (pass@k, maj@n, mean@n) and `evaluate_model`, which
train.py's held-out evaluation (harness/bookkeeping.py) and evaluate.py's command both run.

Article context: the evaluation of the trained policy, the number the article's results are quoted
in (DAPO lifts Qwen2.5-32B on AIME 2024 from 30 to 50, avg@32: the mean accuracy of 32 samples per
problem at temperature 1.0, top-p 0.7).

With n = --eval-samples samples of problem i, c_i of them correct (score > 0):
    mean@n   = mean_i c_i / n (avg@n; with 0/1 scores it equals pass@1), mean@n_std its std over
               problems
    pass@k   = mean_i [1 - C(n - c_i, k) / C(n, k)]   (Chen et al. 2021, unbiased; k = 1, 2, 4, ...
               <= n)
    maj@n    = mean_i [the answer most samples give is right]  (each sample votes for its
               canonical final answer, or for the reference when the reward credits it: `votes`)
n = 1 is greedy decoding (temperature 0), as train.py always did: eval/accuracy. Problem i's samples
come from a generator seeded by (seed, i) alone, so 1 rank and N ranks draw the same, and every
evaluation of a run draws with the same randomness (before/after comparisons are paired).
"""
from __future__ import annotations

import math
import zlib

import torch

import verifier
from harness import data, models
from harness.rollout import sample_rollout

EVAL_BATCH = 128  # responses sampled at once (problems per batch: EVAL_BATCH // n, at least 1)


# ---------------------------------------------------------------------------------------------
# The estimators: pure functions
# ---------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, Eq. 1).

    As a product, C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), so no huge binomial is formed.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... <= n."""
    return [2 ** j for j in range(n.bit_length()) if 2 ** j <= n]


def majority_vote(answers: list[str | None]) -> str | None:
    """The answer given most often; None (no final answer) never wins unless every answer is None.
    Ties go to the answer that appears first in `answers` (the first-drawn sample's
    answer, if it is tied)."""
    counts: dict[str, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    # max keeps the first of equal counts: insertion order
    return max(counts, key=counts.get) if counts else None


# majority voting compares these canonical final answers
canonical_answer = verifier.canonical_answer
# the vote of a sample the reward credits (a space between letters: never a canonical text)
CREDITED = "the reference"


def votes(answers: list[str | None], scores: list[float]) -> list[str | None]:
    """What each sample votes for, so that the vote counts what the reward counts: a sample the
    reward credits (score > 0, as pass@k counts it) votes for the reference answer (CREDITED), any
    other for its canonical final answer (None: the verifier reads none). With the default verifier
    this is the vote by canonical answers (a credited answer is the reference's); with a custom
    --reward it still holds where the verifier cannot read the answers (a format of the reward's
    own, such as answer tags)."""
    return [CREDITED if s > 0 else a for a, s in zip(answers, scores)]


def problem_record(index: int, row: dict, responses: list[str], scores: list[float],
                   lengths: list[int],
                   truncated: list[bool]) -> dict:
    """One problem's line of the per-problem file: its n samples,
    their scores and answers, and the vote."""
    answers = [canonical_answer(r) for r in responses]
    ballot = votes(answers, scores)
    vote = majority_vote(ballot)
    return {"index": index, "prompt": row["prompt"], "reference": row["answer"],
            "samples": [{"response": r, "answer": a, "score": s, "length": n, "truncated": t}
                        for r, a, s, n, t in zip(responses, answers, scores, lengths, truncated)],
            "correct": sum(s > 0 for s in scores), "majority": vote,
            "majority_score": (next((s for v, s in zip(ballot, scores) if v == vote), 0.0)
                               if vote is not None else 0.0)}


def totals(records: list[dict], ks: list[int]) -> torch.Tensor:
    """Sums over `records` that eval_metrics() turns into means:
    [problems, sum mean, sum mean^2, sum pass@k for each k, sum maj, samples, truncated, tokens]
    (float64, so ranks' sums all-reduce exactly)."""
    t = torch.zeros(7 + len(ks), dtype=torch.float64)
    for r in records:
        s = r["samples"]
        acc = sum(x["score"] for x in s) / len(s)
        t += torch.tensor([1.0, acc, acc * acc,
                           *(pass_at_k(len(s), r["correct"], k) for k in ks), r["majority_score"],
                           len(s), sum(x["truncated"] for x in s), sum(x["length"] for x in s)],
                           dtype=torch.float64)
    return t


def eval_metrics(t: torch.Tensor, n: int, ks: list[int]) -> dict:
    """The eval/* metrics from totals() summed over all ranks: greedy keys for n = 1,
    sampled ones for n > 1."""
    P, s1, s2, *rest = t.tolist()
    passes, (maj, samples, trunc, tokens) = rest[:len(ks)], rest[len(ks):]
    common = {"eval/truncated_frac": trunc / samples, "eval/len_mean": tokens / samples}
    if n == 1:
        return {"eval/accuracy": s1 / P, **common}
    return {f"eval/mean@{n}": s1 / P,
            f"eval/mean@{n}_std": math.sqrt(max(s2 / P - (s1 / P) ** 2, 0.0)),
            **{f"eval/pass@{k}": p / P for k, p in zip(ks, passes)},
            f"eval/maj@{n}": maj / P, **common}


def headline(n: int) -> str:
    """The metric that stands for accuracy: greedy accuracy, or mean@n with n samples."""
    return "eval/accuracy" if n == 1 else f"eval/mean@{n}"


# ---------------------------------------------------------------------------------------------
# Evaluating a model on rows, split over ranks
# ---------------------------------------------------------------------------------------------

def eval_generator(seed: int, index: int) -> torch.Generator:
    """Sampling randomness of held-out problem `index`: a function of (seed, index)
    alone, never of the rank."""
    return torch.Generator().manual_seed(zlib.crc32(f"eval:{seed}:{index}".encode()))


class OneProcess:
    """The Dist interface evaluate_model needs (rank, world, sum) for a single process."""
    rank, world = 0, 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.float64).clone()


@torch.no_grad()
def evaluate_model(model, tokenizer, rows: list[dict], args, ranks, reward_fn=None,
                   sample=None) -> tuple[dict, list[dict]]:
    """(metrics over all ranks, this rank's per-problem records) of `model` on `rows` ({"prompt",
    "answer"}).

    Rank r takes problems r, r + world, ...; `args` carries EvalArgs' fields. `reward_fn` scores
    the responses: a data.Reward, or one function f(response, answer) (default: the --reward
    functions and weights). `sample` draws the responses: None for sampler.sample_groups, or a vLLM
    engine's (train.py --rollout vllm), which holds its own weights and runs without autocast."""
    n, ks = args.eval_samples, pass_ks(args.eval_samples)
    greedy = n == 1
    temperature, top_p = (0.0, 1.0) if greedy else (args.eval_temperature, args.eval_top_p)
    if reward_fn is None:
        reward_fn = data.Reward.load(args.reward, args.reward_weights)
    reward_fn = data.as_reward(reward_fn)
    encode = data.PromptFormatter(tokenizer, args.prompt_template, args.system_prompt,
                                  args.chat_template, args.max_prompt_tokens)
    eos = models.end_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    mine = list(range(ranks.rank, len(rows), ranks.world))
    per = max(1, EVAL_BATCH // n)
    # as many batches on every rank as rank 0 (the most rows) has: an engine sharded over ranks
    # (--vllm-tensor-parallel-size) gathers its group's prompts in each batch, a collective, so a
    # rank out of rows still samples (none); sampler.py's batches are the rank's own
    batches = math.ceil(math.ceil(len(rows) / ranks.world) / per)
    records = []
    for start in range(0, batches * per, per):
        idx = mine[start:start + per]
        if not idx and sample is None:
            continue
        prompts = [encode(rows[i]["prompt"]) for i in idx]
        generators = None if greedy else [eval_generator(args.seed, i) for i in idx]
        roll = sample_rollout(model, prompts, n, temperature, top_p, generators, eos,
                              pad, args, sample)
        lengths, truncated = roll.lengths.tolist(), roll.truncated.tolist()  # [len(idx) * n] each
        ids = [roll.response_ids[j, : lengths[j]] for j in range(len(lengths))]  # [L_j] each
        for b, i in enumerate(idx):
            rs = range(b * n, (b + 1) * n)                                    # problem i's rows
            texts = [roll.response_text(j, tokenizer) for j in rs]
            token_ids = lambda rs=rs, ids=ids: [ids[j].tolist() for j in rs]  # noqa: E731
            scores = reward_fn([rows[i]["prompt"]] * n, texts, [rows[i]] * n, token_ids)[0].tolist()
            records.append(problem_record(i, rows[i], texts, scores, [lengths[j] for j in rs],
                                          [truncated[j] for j in rs]))
    return eval_metrics(ranks.sum(totals(records, ks)).cpu(), n, ks), records
