"""Step 1 as the commands run it: sampler.sample_groups under --bf16 autocast with --max-num-seqs
slots (--compile: infra.static_decode's static-shape step), or a vLLM engine's sample_groups.

Article section: "Step 1: Rollout 采样" (sampler.py is the step; this picks how it runs).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

import sampler
from infra import static_decode
from infra.errors import InputError
from sampler import Rollout

_SCALED: set = set()   # the models already warned about (scaled RoPE: the limit is theirs)


def context_limit(model) -> tuple[int | None, bool]:
    """(the positions the model was trained on, `max_position_embeddings` of its text config, or
    None where the config has none; whether its config scales RoPE past them)."""
    c = getattr(getattr(model, "module", model), "config", None)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    limit = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    rope = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    return limit, kind not in (None, "default")


def check_context(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    """The longest prompt + max_new_tokens within the model's context: else errors.InputError (one
    line; a model past its trained positions decodes garbage, and an engine caps the responses
    it is asked for so they come back "truncated"), or one warning where RoPE is scaled."""
    limit, scaled = context_limit(model)
    need = max(map(len, prompts), default=0) + max_new_tokens
    if limit is None or need <= limit:
        return
    what = (f"the longest prompt ({need - max_new_tokens} tokens) + --max-new-tokens "
            f"{max_new_tokens} = {need} positions, past the model's context of {limit} "
            f"(max_position_embeddings)")
    if not scaled:
        raise InputError(f"{what}: lower --max-new-tokens, shorten the prompts, or use a model "
                         f"with a longer context")
    if id(model) not in _SCALED:
        _SCALED.add(id(model))
        warnings.warn(f"{what}; its config scales RoPE, so it may hold them", stacklevel=3)


def sample_rollout(model, prompts: list[list[int]], G: int, temperature: float, top_p: float,
                   generator, eos: list[int], pad: int, args, sample=None) -> Rollout:
    """Step 1 as training (train.rollout) and evaluation (evaluate.evaluate_model) run it:
    sample_groups under --bf16 autocast, at most --max-num-seqs rows at once (default: as many as
    --kv-cache-gb holds); or `sample`, a vLLM engine's sample_groups (train.py --rollout vllm),
    which holds its own weights and --max-num-seqs and runs without autocast. `args` carries
    flags.EvalArgs' fields (max_new_tokens, max_num_seqs, kv_cache_gb, bf16, compile)."""
    T = args.max_new_tokens
    check_context(model, prompts, T)
    if sample is not None:
        return sample(model, prompts, G, T, eos, pad, temperature, top_p, generator=generator)
    with (torch.autocast(next(model.parameters()).device.type, torch.bfloat16, enabled=args.bf16),
          frozen_in(model, torch.bfloat16 if args.bf16 else None)):
        # sized in the dtype the cache is stored in (autocast's, infra/kv_cache.py)
        S = args.max_num_seqs or num_seqs_within(model, prompts, G, T, args.kv_cache_gb)
        return sampler.sample_groups(model, prompts, G, T, eos, pad, temperature, top_p,
                                     generator=generator, max_num_seqs=S,
                                     static=static_decode if args.compile else None)


@contextlib.contextmanager
def frozen_in(model, dtype: torch.dtype | None):
    """Within it, the frozen weights of the model's linear layers (--lora-r's base weights and
    head) are copies in `dtype` (autocast's), made once; the original parameters again after.

    Autocast keeps the casts of weights that require grad for the whole region, but casts a frozen
    weight again at every use: every decode step of a LoRA rollout re-cast every base weight
    (7B: 14 GB of casts a step). The copies hold the values autocast would make. A head tied to
    the embedding gets its own copy (the embedding keeps its float32 weight). None, or a weight
    already in dtype or sharded (DTensor): nothing changes."""
    swapped = []
    if dtype is not None:
        for m in model.modules():
            w = getattr(m, "weight", None)
            if (isinstance(m, torch.nn.Linear) and w is not None and not w.requires_grad
                    and w.dtype != dtype and w.is_floating_point()
                    and type(w.data) is torch.Tensor):
                swapped.append((m, w))
                m._parameters["weight"] = torch.nn.Parameter(w.detach().to(dtype),
                                                             requires_grad=False)
    try:
        yield
    finally:
        for m, w in swapped:
            m._parameters["weight"] = w


def num_seqs_within(model, prompts: list[list[int]], G: int, max_new_tokens: int,
                    budget_gb: float) -> int:
    """The most rows (a multiple of G, at least G) whose KV cache, rows x (P + T) positions, fits in
    budget_gb: one position of one row takes layers x KV heads x head_dim x 2 (K and V) x bytes
    (autocast's dtype if on)."""
    c, device = model.config.get_text_config(), next(model.parameters()).device
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    amp = torch.is_autocast_enabled(device.type)
    nbytes = (torch.get_autocast_dtype(device.type) if amp
              else next(model.parameters()).dtype).itemsize
    per_row = (c.num_hidden_layers * heads * head_dim * 2 * nbytes
               * (max(map(len, prompts), default=0) + max_new_tokens))
    return max(G, int(budget_gb * 2**30 // per_row) // G * G)
