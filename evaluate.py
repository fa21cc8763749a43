"""Evaluation of a saved model, without training: greedy accuracy, or avg@n, unbiased pass@k
and maj@n over n samples (harness/evaluation.py, which train.py's held-out evaluation runs too).

Article context: the evaluation of the trained policy, the number the article's results are quoted
in. The same flags as train.py's evaluation:

    python evaluate.py --model builtin --data builtin                         # greedy accuracy
    python evaluate.py --model builtin runs/latest/final --data builtin --eval-samples 16 \\
        --out per-problem.jsonl
    python evaluate.py --model Qwen/Qwen2.5-Math-7B --data aime24.jsonl --eval-samples 32 \\
        --eval-temperature 1.0 --eval-top-p 0.7 --max-new-tokens 20480         # DAPO's avg@32
"""
from __future__ import annotations

import json
import sys

from harness import data, flags, models, vllm_rollout
from harness.evaluation import OneProcess, evaluate_model
from harness.rollout import check_context
from infra import lm_head
from infra.errors import USER_ERRORS

# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> list[tuple[str, dict]]:
    args = flags.parse_eval_args(argv, __doc__.split("\n\n")[0])
    try:
        rows = data.load_rows(args.data, "eval", args.prompt_field, args.answer_field,
                              args.eval_size, args.data_split)
        reward_fn = data.Reward.load(args.reward, args.reward_weights)
        results, lines = [], []  # (model, metrics) in --model order
        for spec in args.model:
            path, tokenizer, model = models.load_model(spec, args.trust_remote_code)
            if args.fp32_lm_head:
                lm_head.run_in_fp32(model)
            data.PromptFormatter(tokenizer, args.prompt_template, args.system_prompt,
                                 args.chat_template).check(rows, f"--data {args.data}")
            engine = None
            if args.rollout == "vllm":           # the model's own engine, its weights from disk
                check_context(model, [[0]], args.max_new_tokens)
                engine = vllm_rollout.engine_for(  # beside the model's weights alone
                    path, model, args, args.device,
                    vllm_rollout.trainer_resident_bytes(model, optimizer=False),
                    sleep_mode=False)               # one engine per --model, in sequence
            try:
                m, records = evaluate_model(model.to(args.device), tokenizer, rows, args,
                                            OneProcess(), reward_fn,
                                            engine.sample_groups if engine else None)
            finally:
                if engine is not None:
                    engine.close()
            results.append((spec, m))
            lines += [json.dumps({"model": spec, **r}) for r in records]
            del model
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    keys = list(results[0][1])
    print(f"{len(rows)} problems of {args.data}, " + ("greedy" if args.eval_samples == 1 else
          f"{args.eval_samples} samples each at temperature {args.eval_temperature}, top-p "
          f"{args.eval_top_p}") +
          f", at most {args.max_new_tokens} new tokens")
    print("| model | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    for spec, m in results:
        print(f"| {spec} | " + " | ".join(f"{m[k]:.3f}" if k != "eval/len_mean" else f"{m[k]:.1f}"
                                          for k in keys) + " |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
        print(f"per-problem records: {args.out}")
    return results


if __name__ == "__main__":
    main()
