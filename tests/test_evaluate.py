"""evaluate.py: pass@k, maj@n, mean@n by hand, over ranks, the command's flags, and --max-num-seqs
in evaluation and in train.py's rounds.

    python -m pytest -q tests/test_evaluate.py
"""
from __future__ import annotations

import pytest
import torch

from harness import builtin, data, flags, models, setup
from helpers import tiny
from sampler import sample_groups
from verifier import (
    canonical,
    canonical_answer,
    extract_answer,
    verify,
)


def test_pass_at_k_equals_enumerating_every_k_subset():
    import itertools

    from harness import evaluation
    for n in range(1, 8):
        for c in range(n + 1):
            # samples 0..c-1 are the correct ones; the share of k-subsets holding one
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                want = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_and_bad_input():
    from harness import evaluation
    # one correct of 1000, half drawn
    assert evaluation.pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    # pass@1 = c / n
    assert evaluation.pass_at_k(2000, 10, 1) == pytest.approx(10 / 2000, abs=1e-12)
    assert evaluation.pass_at_k(1000, 0, 1000) == 0.0 and evaluation.pass_at_k(1000, 1, 1000) == 1.0
    assert (evaluation.pass_ks(1) == [1] and evaluation.pass_ks(6) == [1, 2, 4]
            and evaluation.pass_ks(32) == [1, 2, 4, 8, 16, 32])
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            evaluation.pass_at_k(n, c, k)


@pytest.mark.parametrize("answers,want", [
    (["4", "5", "4"], "4"),
    (["5", "4", "4", "5"], "5"),               # a tie: the answer that appeared first wins
    # None is the commonest but never wins over an answer
    (["4", None, "5", None, None, "5"], "5"),
    ([None, "3", None], "3"),
    ([None, None], None), ([], None),           # no answer at all
    (["7"], "7"),
])
def test_majority_vote_by_hand(answers, want):
    from harness import evaluation
    assert evaluation.majority_vote(answers) == want


def _record(i, responses, scores, lengths=None, truncated=None):
    from harness import evaluation
    n = len(responses)
    return evaluation.problem_record(i, {"prompt": f"p{i}", "answer": "4"}, responses, scores,
                                   lengths or [3] * n, truncated or [False] * n)


def test_eval_metrics_by_hand():
    from harness import evaluation
    # problem 0: 2 of 4 right; '4' wins the vote (the first sample's '6' does not): maj right
    # problem 1: none right; Nones never win, and of the tied '3' and '7' the first to appear does:
    # maj wrong
    a = _record(0, ["Answer: 6", "Answer: 4", "so \\boxed{4}", "Answer: 5"], [0.0, 1.0, 1.0, 0.0],
                [2, 4, 4, 2], [False] * 4)
    b = _record(1, ["no", "Answer: 3", "x", "Answer: 7"], [0.0] * 4, [6, 6, 6, 6],
                [True, True, False, False])
    # the right '4' won
    assert a["majority"] == evaluation.CREDITED and a["majority_score"] == 1.0 and a["correct"] == 2
    assert b["majority"] == evaluation.canonical_answer("Answer: 3") and b["majority_score"] == 0.0
    ks = evaluation.pass_ks(4)
    m = evaluation.eval_metrics(evaluation.totals([a, b], ks), 4, ks)
    assert m == pytest.approx({
        "eval/mean@4": (0.5 + 0.0) / 2, "eval/mean@4_std": 0.25,  # population std of (0.5, 0.0)
        # problem 0: 1 - C(2,2)/C(4,2); problem 1: 0
        "eval/pass@1": 0.25, "eval/pass@2": (1 - 1 / 6) / 2,
        "eval/pass@4": 0.5, "eval/maj@4": 0.5, "eval/truncated_frac": 2 / 8,
        "eval/len_mean": 36 / 8})
    g = evaluation.eval_metrics(evaluation.totals([_record(0, ["Answer: 4"], [1.0]),
                                               _record(1, ["Answer: 5"], [0.0])], [1]), 1, [1])
    # greedy: today's keys
    assert g == {"eval/accuracy": 0.5, "eval/truncated_frac": 0.0, "eval/len_mean": 3.0}


def test_majority_vote_counts_what_the_reward_counts():
    from harness import evaluation

    def tagged(response, answer):  # a custom --reward that reads a format the verifier does not
        return float(response.strip() == f"<answer>{answer}</answer>")
    # 2 of 3 samples right by the reward, none readable by the verifier: the vote is right, as
    # mean@3 says
    responses = ["<answer>4</answer>", "<answer>7</answer>", "<answer>4</answer>"]
    r = _record(0, responses, [tagged(x, "4") for x in responses])
    assert [s["answer"] for s in r["samples"]] == [None] * 3
    assert r["majority"] == evaluation.CREDITED
    assert r["majority_score"] == 1.0
    # wrong answers the verifier reads still outvote one right answer; the right one wins a tie
    # drawn first
    r = _record(1, ["<answer>4</answer>", "Answer: 6", "6"], [1.0, 0.0, 0.0])
    assert r["majority"] == canonical("6") and r["majority_score"] == 0.0
    r = _record(2, ["<answer>4</answer>", "Answer: 6"], [1.0, 0.0])
    assert r["majority"] == evaluation.CREDITED and r["majority_score"] == 1.0
    # the default verifier: a credited answer is the reference's, so this is the vote by canonical
    # answers
    responses = ["Answer: 6", "\\boxed{4}", "4", "Answer: 6", "x = 4"]
    scores = [verify(x, "4") for x in responses]
    plain = evaluation.majority_vote([canonical_answer(x) for x in responses])
    assert plain == canonical("4") and evaluation.majority_vote(evaluation.votes(
        [canonical_answer(x) for x in responses], scores)) == evaluation.CREDITED
    # never a canonical text
    assert canonical_answer("Answer: " + evaluation.CREDITED) != evaluation.CREDITED


def test_majority_vote_merges_one_answer_written_three_ways():
    from harness import evaluation
    # 2 of 5 samples right (4); three wrong ones give 1/2 as 0.5, \frac{1}{2} and 1/2: one answer,
    # so it has the majority (3 votes to 2), maj@5 is 0. Voted as written, they would split 1-1-1
    # and the right 4 would win.
    responses = ["\\boxed{4}", "Answer: 0.5", "so \\boxed{\\frac{1}{2}}", "x = 4",
                 "the answer is 1/2"]
    scores = [verify(x, "4") for x in responses]
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert len({extract_answer(responses[i]) for i in (1, 2, 4)}) == 3     # three texts, one number
    r = _record(0, responses, scores)
    half, four = canonical("1/2"), canonical("4")
    assert [s["answer"] for s in r["samples"]] == [four, half, half, four, half]
    assert r["majority"] == canonical("1/2") and r["majority_score"] == 0.0 and r["correct"] == 2
    m = evaluation.eval_metrics(evaluation.totals([r], [1]), 5, [1])
    assert m["eval/maj@5"] == 0.0 and m["eval/mean@5"] == pytest.approx(0.4)


class _Rank:
    """Dist for one rank of `world` without a process group: sum returns this rank's share."""
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def sum(self, x):
        return x.detach().double().clone()


def _eval_setup(d, *extra):
    """train.py's flags (flags.TrainArgs), the tiny model with large random weights (the fixture's
    answers '\n' to every prompt
    greedily; these give each prompt its own answer), and 12 built-in held-out problems."""
    args = flags.parse_train_args(["--model", str(d / "model"), "--max-new-tokens", "10",
                                   "--device", "cpu", *extra])
    _, tok, model = models.load_model(args.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return args, tok, model, builtin.sample_problems(12, 2, True)


# the random model is never right: this scores some of its responses 1
def _has_9(response, answer):
    return float("9" in response)


def test_greedy_evaluation_equals_greedy_rollouts_scored_by_hand(tiny_run_inputs):
    from harness import evaluation
    args, tok, model, rows = _eval_setup(tiny_run_inputs)
    reward = _has_9
    m, records = evaluation.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    # one greedy answer per problem, scored here: sums of reward, truncation, length
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in rows], 1, 10, eos, tok.pad_token_id,
                         temperature=0.0)
    texts = [tok.decode(roll.response_ids[i, : roll.lengths[i]], skip_special_tokens=True)
             for i in range(len(rows))]
    correct = sum(reward(t, r["answer"]) for t, r in zip(texts, rows))
    assert 0 < correct < len(rows) and 0 < roll.truncated.sum() < len(rows)
    assert m == {"eval/accuracy": correct / len(rows),
                 "eval/truncated_frac": roll.truncated.sum().item() / len(rows),
                 "eval/len_mean": roll.lengths.sum().item() / len(rows)}
    assert [s["response"] for r in records for s in r["samples"]] == texts
    assert evaluation.headline(1) == "eval/accuracy" and evaluation.headline(8) == "eval/mean@8"


def test_sampled_evaluation_is_the_same_split_over_ranks(tiny_run_inputs, monkeypatch):
    from harness import evaluation
    # 2 problems per batch: each rank batches other problems together
    monkeypatch.setattr(evaluation, "EVAL_BATCH", 8)
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p",
                                         "0.9")
    reward = _has_9
    m1, r1 = evaluation.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    parts = [evaluation.evaluate_model(model, tok, rows, args, _Rank(k, 3), reward)[1]
             for k in range(3)]
    # same samples, scores, votes
    assert sorted((r for p in parts for r in p), key=lambda r: r["index"]) == r1
    ks = evaluation.pass_ks(4)
    assert evaluation.eval_metrics(sum(evaluation.totals(p, ks) for p in parts), 4,
                                 ks) == pytest.approx(m1, abs=1e-12)
    scores = [[s["score"] for s in r["samples"]] for r in r1]
    assert (m1["eval/mean@4"] == pytest.approx(sum(map(sum, scores)) / 48)
            == pytest.approx(m1["eval/pass@1"]))
    assert m1["eval/pass@1"] <= m1["eval/pass@2"] <= m1["eval/pass@4"] == sum(map(max, scores)) / 12
    # samples differ between problems
    assert len({tuple(s["response"] for s in r["samples"]) for r in r1}) == 12
    assert len({s["response"] for s in r1[0]["samples"]}) > 1                   # and within one


def test_each_rank_reports_the_metrics_of_all_ranks_problems(tiny_run_inputs):
    # 3 ranks as threads (their sums meet; _Rank's see one rank alone): every rank's metrics are
    # those of one process on all 12 problems, not of its own 4, and its records its own problems
    import copy

    from harness import evaluation
    from launch import on_thread_ranks
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p",
                                         "0.9")
    m1, r1 = evaluation.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    models_ = [copy.deepcopy(model) for _ in range(3)]       # a rank's own copy, as on its process
    out = on_thread_ranks(3, lambda ranks: evaluation.evaluate_model(
        models_[ranks.rank], tok, rows, args, ranks, _has_9))
    assert 0 < m1["eval/mean@4"] < 1
    for rank, (m, records) in enumerate(out):
        assert m == pytest.approx(m1, abs=1e-12), rank
        assert records == [r for r in r1 if r["index"] % 3 == rank]


def test_draw_round_and_evaluation_sample_with_max_num_seqs(tiny_run_inputs, monkeypatch):

    import sampler
    import train
    from harness import evaluation
    seen = []

    def recording(*a, max_num_seqs=None, **k):
        seen.append(max_num_seqs)
        return sample_groups(*a, max_num_seqs=max_num_seqs, **k)
    # rollout.sample_rollout reads it at call time
    monkeypatch.setattr(sampler, "sample_groups", recording)
    model = tiny("qwen2", torch.float32)
    task = setup.Task(rows=[{"prompt": "p", "answer": "1"}] * 4, encode=lambda s: [5, 6, 7],
                      decode=lambda r, i: "",
                      reward_fn=data.as_reward(lambda t, a: 0.0), eos=[1], pad=0)
    one = type("One", (), {"rank": 0, "world": 1})()
    for extra, want in (([], None), (["--max-num-seqs", "16"], 16)):
        args = flags.parse_train_args(["--prompts-per-step", "4", *extra])
        train.draw_round(model, task, args, one, 0)
        assert seen.pop() == want
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p",
                                         "0.9")
    _, r1 = evaluation.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    args.max_num_seqs = 5                      # one problem's 4 samples at a time: the same samples
    _, r2 = evaluation.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    assert r1 == r2 and seen[-1] == 5 and seen[0] is None
