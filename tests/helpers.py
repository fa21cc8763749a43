"""The helpers the tests share: tiny models, prompts at a real run's shape, the tiny run's inputs,
running train.py for a step, spies. Not an article section.

test_grpo.py and every file of tests/ import them (pyproject's pytest pythonpath holds tests/);
the --reward functions the runs name stay in test_grpo.py (`--reward test_grpo:has_x`).
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import logprobs
import update
from harness import builtin
from sampler import Rollout, sample_groups

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]]


# prompts at a real run's shape: a shared 140-token instruction (longer than a 128-token KV block),
# then each prompt's own 3, 6 and 1 tokens, so the prompts still differ in length and are
# left-padded
INSTRUCTION = [int(t) for t in torch.randint(2, 40, (140,),
                                             generator=torch.Generator().manual_seed(4))]


LONG_PROMPTS = [INSTRUCTION + p for p in PROMPTS]


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """A tiny random model with the built-in tokenizer, and small train / eval JSONL files."""
    d = tmp_path_factory.mktemp("tiny")
    tok = builtin.make_tokenizer()
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=32, intermediate_size=64,
                                                       num_layers=2), len(tok))
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    for name, rows in (("train.jsonl", builtin.sample_problems(64, 1, False)),
                       ("eval.jsonl", builtin.sample_problems(8, 2, True))):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a random model never answers right: this reward (through --reward) gives its groups mixed
    # rewards
    (d / "tinyreward.py").write_text("def has_x(response, answer):\n    return float('x' in "
                                     "response)\n")
    return d


def tiny_flags(d, out):
    """train.py flags for a short CPU run of the tiny model on the tiny data (flags given after
    these win)."""
    return ["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--eval-data",
            str(d / "eval.jsonl"),
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--lr",
            "1e-2", "--reward", "test_grpo:has_x", "--out", str(out), "--device", "cpu"]


def weights_of(folder):
    from transformers import AutoModelForCausalLM
    return {k: v.clone() for k,
            v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def one_step(d, out, *extra):
    import train
    train.main([*tiny_flags(d, out), "--steps", "1", "--eval-every", "5", "--grad-clip", "0",
                "--algo", "dapo", "--no-dynamic-sampling", *extra])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x][-1]


def read_file(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def spy_on(monkeypatch, module, name):
    """Calls of module.name (arguments, return value) recorded as they happen; the real one runs."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append((args, real(*args, **kwargs)))
        return seen[-1][1]
    monkeypatch.setattr(module, name, spy)
    return seen


def reduce_by_hand(per_token, mask, reduction="sequence", num_tokens=None, max_len=None,
                    num_seqs=None):
    """The three reductions written out (the reference for token_weights): "sequence" = the sum of
    each
    response's token mean / num_seqs (default: the non-empty rows), "token" = the masked sum /
    num_tokens (default: mask.sum()), "constant" = the masked sum / (num_seqs * max_len) (default
    max_len: T)."""
    rows = mask.sum(-1)                                                       # [N]
    n = (rows > 0).sum() if num_seqs is None else num_seqs
    if reduction == "sequence":
        return ((per_token * mask).sum(-1) / rows.clamp_min(1)).sum() / n
    if reduction == "token":
        return (per_token * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)
    return (per_token * mask).sum() / (n * (mask.shape[1] if max_len is None else max_len))


def tiny_gpt2(vocab: int = 40, seed: int = 0, positions: int = 256, pad_token_id=0,
              bos_token_id=None):
    """A tiny GPT-2: absolute position embeddings, so position ids that ignore the left padding
    change its log-probs (RoPE models, the others here, see only the distance between
    positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=positions, pad_token_id=pad_token_id,
                                      eos_token_id=1, bos_token_id=bos_token_id)).eval()


def mixed_rollout(model, temperature, G=4, T=20, prompts=PROMPTS):
    """PROMPTS (3, 6 and 1 tokens; LONG_PROMPTS: 143, 146, 141) x G samples, some ending in EOS and
    some
    truncated."""
    roll = sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0,
                         temperature=temperature, generator=torch.Generator().manual_seed(3))
    assert len(set(roll.lengths.tolist())) > 2 and roll.truncated.any() and (~roll.truncated).any()
    return roll


def tiny(kind, dtype):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    if kind == "qwen2":  # GQA, q/k/v biases, tied embeddings: the preallocated cache
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common)).eval().to(dtype)
    # sliding-window layers
    return MistralForCausalLM(MistralConfig(sliding_window=5, **common)).eval().to(dtype)


def sgd_update(model, roll: Rollout, advantages: torch.Tensor, **flags):
    """A copy of `model` after one update_policy on `roll` (all its rows, token reduction, beta 0,
    no clip or correction) by SGD at lr 1, so that the weights move by minus the gradient; `flags`
    override update_policy's flags.TrainArgs fields (temperature, top_p, ...)."""
    import contextlib
    import copy
    from types import SimpleNamespace

    from infra import parallel
    args = SimpleNamespace(**{**dict(
        micro_batch_size=5, micro_batch_tokens=10**6, mini_batches=1, mu=1, temperature=1.0,
        top_p=1.0, reduction="token", loss="ppo", fsdp=False, gradient_checkpointing=False,
        max_new_tokens=roll.response_ids.shape[1], eps_low=0.2, eps_high=0.28, clip_c=0.0,
        tis_cap=0.0, off_policy_mask=0.0, entropy_coef=0.0, beta=0.0, kl="k3", grad_clip=0.0,
        lr=1.0), **flags})
    mine = copy.deepcopy(model).train()
    learner = update.Learner(mine, mine, None, torch.optim.SGD(mine.parameters(), lr=1.0),
                             contextlib.nullcontext)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        update.update_policy(learner, roll, advantages, roll.mask, args, parallel.Dist("cpu"))
    return mine


def tiny_gpt2_sampler():
    """tiny_gpt2 as the sampler's tests build it (48 ids, 128 positions): a position counted from
    the wrong origin changes the logits (RoPE hides a constant offset within a row)."""
    return tiny_gpt2(48, seed=2, positions=128, pad_token_id=None, bos_token_id=0)


MIXED_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4], [13, 14, 15, 16, 17], [18, 19]]


def fake_rollout(rewards: list[list[float]], start: int = 0) -> Rollout:
    B, G = len(rewards), len(rewards[0])
    N = B * G
    return Rollout(prompts=[[start + i] for i in range(B)], G=G, pad_token_id=0,
                   response_ids=torch.ones(N, 2, dtype=torch.long), mask=torch.ones(N, 2),
                   lengths=torch.full((N,), 2), truncated=torch.zeros(N, dtype=torch.bool),
                   logprobs=torch.zeros(N, 2), correct=torch.tensor(rewards).view(-1),
                   # [N] prompt positions
                   index=torch.arange(start, start + B).repeat_interleave(G))


def full_forward_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[:, len(prompt) - 1:-1] / temperature
    return logprobs.token_logprobs(logits, ids[:, len(prompt):])[0]
