"""How the article's steps run fast and at scale: the mechanisms below the article's modules.

Not an article section. Imports nothing above it (not the article's modules, not harness/;
tests/test_layout.py checks), so each piece reads alone:

- kv_cache: the sampler's preallocated KV cache and the prefill it shares with the training forward
- packed: the rollout's matmuls on weights packed once by oneDNN (CPU)
- lm_head: the LM head fused with the log-softmax (no [n, T, V] logits) and the nucleus rule
- parallel: DDP, FSDP2, the all-reduces every rank calls together
- errors: the user-facing error classes
"""
