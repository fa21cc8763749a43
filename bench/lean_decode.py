"""The eager decode step as plain ops (infra/lean_decode.py) vs the Hugging Face forward, inside
sample_groups: seconds each, interleaved, and how far the two rollouts agree (greedy tokens; sampled
rows: a near-uniform distribution, such as a random-init model's over 32,000 ids, can flip a draw
on float rounding and the row goes on differently). A section of `python -m bench`.

    python -m bench --only lean --threads 0 --repeats 5   # both cores, as train.py runs
"""
from __future__ import annotations

import statistics

import torch

from bench.common import qwen_39m, timed
from infra import builtin
from sampler import sample_groups


def _cases():
    """(title, model, prompts, G, T, eos, pad): the built-in task's default rounds (the base model,
    32 and 128 prompts x G = 8, 40 new tokens), bench.vs_trl's long one (the architecture randomly
    initialised, 16 x 8, 64 new tokens) and python -m bench --only rollouts' 38.9M Qwen2 (8 x 8)."""
    from transformers import AutoModelForCausalLM
    tok = builtin.make_tokenizer()
    base = AutoModelForCausalLM.from_pretrained(builtin.base_model(), dtype=torch.float32).eval()
    torch.manual_seed(0)
    random = builtin.make_model(builtin.BaseModelConfig(), len(tok)).eval()
    problems = builtin.sample_problems(128, 5, False)
    ids = [tok(p["prompt"])["input_ids"] for p in problems]
    qwen = qwen_39m().eval()
    q_prompts = torch.randint(2, qwen.config.vocab_size, (8, 32),
                              generator=torch.Generator().manual_seed(0)).tolist()
    ends = (tok.eos_token_id, tok.pad_token_id)
    return [("built-in base model, 32 x 8 rows, 40 new tokens (a default round)", base, ids[:32],
             8, 40, *ends),
            ("built-in base model, 128 x 8 rows, 40 new tokens (four rounds)", base, ids, 8, 40,
             *ends),
            ("built-in architecture, random init, 16 x 8 rows, 64 new tokens (bench.vs_trl)",
             random, ids[:16], 8, 64, *ends),
            ("38.9M Qwen2, random init, 8 x 8 rows of 32-token prompts, 64 new tokens", qwen,
             q_prompts, 8, 64, 1, 0)]


def bench_lean(device: str, repeats: int) -> None:
    print(f"\n## The decode step as plain ops (infra/lean_decode.py) vs the HF forward, inside "
          f"sample_groups, {device}")
    if device != "cpu":
        print("  (CPU only: on a GPU sample_groups decodes through the HF forward)")
        return
    print(f"{'':78s}{'HF s':>8s}{'lean s':>8s}{'lean/HF':>9s}  same rollout")
    for title, model, prompts, G, T, eos, pad in _cases():
        def run(lean: bool, temperature=1.0, model=model, prompts=prompts, G=G, T=T, eos=eos,
                pad=pad):
            gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
            return sample_groups(model, prompts, G, T, eos, pad, temperature=temperature,
                                 generator=gens, lean=lean)
        run(True), run(False)                                                  # warm-up
        times = {True: [], False: []}
        for r in range(repeats):
            for lean in ((True, False) if r % 2 else (False, True)):
                dt, roll = timed(lambda lean=lean: run(lean), device)
                times[lean].append(dt)
        greedy = torch.equal(run(False, 0.0).response_ids, run(True, 0.0).response_ids)
        a, b = run(False), run(True)
        agree = (a.response_ids == b.response_ids).cumprod(1).bool()  # [N, T] a common prefix
        rows = int(agree.all(1).sum())
        diff = float((a.logprobs - b.logprobs)[agree].abs().max())
        hf, lean = statistics.median(times[False]), statistics.median(times[True])
        print(f"  {title:76s}{hf:8.3f}{lean:8.3f}{lean / hf:9.2f}  greedy "
              f"{'the same' if greedy else 'NOT THE SAME'}; sampled: {rows} of {a.lengths.numel()} "
              f"rows the same, log-probs within {diff:.1e} while they agree")
