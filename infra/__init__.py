"""What a real run needs beyond the article, one module per concern.

The top level is the article (grpo, dapo, sampler, verifier, logprobs, update, train, evaluate);
this folder holds the rest, which the article's modules and the two commands import:

- the command line: flags (every flag, with its help), setup (the run's set-up: data, policy,
  reference, engine, optimizer, resume), bookkeeping (the step's metrics row, held-out evaluation,
  checkpoints, the final model)
- the task and its data: data (rows, prompts, rewards), builtin (the built-in task and base model)
- the objective's family: variants (--loss, --kl, --entropy-coef, --tis-cap)
- ranks and memory: parallel (DDP, FSDP2, all-reduces), lora (--lora-r), lm_head (the LM head
  fused with the log-softmax: no [n, T, V] logits)
- disk: checkpoint (atomic saves, resume, the run lock), models (loading and saving a model)
- what is measured: metrics (the metric rows and run files), perf (model FLOPs and MFU), curves
- how Step 1 runs: kv_cache (the sampler's preallocated KV cache and prefill),
  vllm_rollout (--rollout vllm), rollout (Step 1 as the commands call it, and the
  --kv-cache-gb sizing)
- errors: the user-facing error classes
"""
