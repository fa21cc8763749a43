"""The eager decode step of a Llama-family model in a few plain tensor ops, not through the Hugging
Face forward.

Article section: "Step 1: Rollout 采样" (the old policy decodes its G answers token by token; this
is how one decode step is computed on a CPU, not what is sampled).

A decode step feeds one token per row. Through the HF forward that is, per layer, 35 or so small
ops plus their Python (the attention mask rebuilt from the 2-D one at every step, module hooks,
the output classes), a cost that does not shrink with the rows. Here the same step is: the
embedding, per layer an RMSNorm, one matmul for q, k and v (their weights concatenated
once per rollout), RoPE from the model's own rotary module, the new K/V written by
sampler.sample_groups' buffers (kv_cache.BufferedLayer.update) at each row's column, SDPA over the
columns in use under the rows' mask (a KV head's query heads stacked as its queries, no K/V copied
per head), o_proj, an RMSNorm, one matmul for gate and up, SiLU, down_proj; then the final norm and
the LM head on each row's one position. A rollout takes 0.82-0.98x the time (`python -m bench
--only lean`, docs/speed.md).

Exact up to float rounding (the sums run in another order): `test_lean_decode_is_the_hf_rollout`
holds the rollout's tokens equal and its log-probs within 1e-5 on a Llama and a Qwen2 (GQA, q/k/v
biases) with left-padded prompts. `LeanDecoder.build` says where it applies; elsewhere (another
architecture, attention other than SDPA, LoRA's wrapped layers, FSDP2's sharded weights, autocast,
a GPU, a sliding window) the HF forward runs as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from infra import packed

# architectures whose decoder layer is exactly: x += o(attn(rope(q), rope(k), v)) of RMSNorm(x);
# x += down(silu(gate) * up) of RMSNorm(x) (no q/k norms, no sliding window, no soft-capping)
FAMILY = ("llama", "qwen2", "mistral")


def _plain(*mods) -> bool:
    """Every module a plain nn.Linear with float32 CPU weights held as plain parameters."""
    return all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
               for m in mods)


def _linear(rows: int, pack: bool, *mods):
    """x -> x @ w.T + b for several Linears of the same input as one (their weights [sum out, in]
    and biases concatenated), through oneDNN's packed weight where the rollout packs (`pack`:
    packed.packed_linears is on) and infra/packed.py packs each of them (by the size of the weights
    as the model has them: the built-in model's, all under packed.MIN_WEIGHT, multiply as stored).
    One Linear: its own forward, which packed_linears has already set to the packed one."""
    if len(mods) == 1:
        return mods[0].forward
    w = torch.cat([m.weight.detach() for m in mods])                           # [sum out, in]
    b = None if all(m.bias is None for m in mods) else torch.cat(
        [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
         for m in mods])
    if pack and min(m.weight.numel() for m in mods) >= packed.MIN_WEIGHT:
        return packed.packed_forward(w, b, rows)
    return lambda x: F.linear(x, w, b)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """The HF RMSNorm (LlamaRMSNorm and its copies) in float32: weight * x / sqrt(mean(x^2) + eps),
    without its module's casts and call (3-4% of a 32-row step)."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] rotated by cos, sin [n, 1, D] (HF's rotate_half convention)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class LeanDecoder:
    """A model's decode step as plain ops over fused weights, built once per rollout (`build`);
    `step` is one forward of one token per row."""

    def __init__(self, model, rows: int, pack: bool):
        self.model, inner = model, model.model
        c = model.config
        self.Hq, self.Hk = c.num_attention_heads, c.num_key_value_heads
        self.D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm,
                                _linear(rows, pack, a.q_proj, a.k_proj, a.v_proj),
                                _linear(rows, pack, a.o_proj), a.scaling,
                                layer.post_attention_layernorm,
                                _linear(rows, pack, m.gate_proj, m.up_proj),
                                _linear(rows, pack, m.down_proj)))
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self.norm = inner.norm
        self.head = _linear(rows, pack, model.lm_head)

    @staticmethod
    def build(model, rows: int, pack: bool = False) -> LeanDecoder | None:
        """The decoder for `model`, or None where the HF forward must run: a model outside FAMILY
        or not laid out as its HF class, attention other than SDPA (the user's eager or flash), a
        layer that is not a plain float32 CPU nn.Linear (LoRA, FSDP2, another dtype or device),
        autocast on, a sliding window, an MLP other than SiLU. Built inside the rollout's
        packed.packed_linears (pack: what it yielded), whose packed forwards it keeps."""
        c = model.config
        inner = getattr(model, "model", None)
        if (getattr(c, "model_type", None) not in FAMILY or inner is None
                or getattr(c, "_attn_implementation", None) != "sdpa"
                or torch.is_autocast_enabled("cpu") or getattr(c, "hidden_act", None) != "silu"
                or getattr(c, "pretraining_tp", 1) != 1
                or (getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True))
                or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head")):
            return None
        for layer in inner.layers:
            a, m = layer.self_attn, getattr(layer, "mlp", None)
            if (m is None or not _plain(a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
                                        m.up_proj, m.down_proj)
                    or any(hasattr(a, x) for x in ("q_norm", "k_norm"))):
                return None
        if not _plain(model.lm_head):
            return None
        return LeanDecoder(model, rows, pack)

    def step(self, tok: torch.Tensor, pos: torch.Tensor, cache,
             attn: torch.Tensor) -> torch.Tensor:
        """tok, pos [n] (the rows' tokens and positions), cache: the rollout's
        kv_cache.BufferedLayer per layer, its `at` and `seen` set for this step as for the HF
        forward, attn [n, L] the columns each row sees (L: in use) -> the next tokens' logits
        [n, V]."""
        n, Hq, Hk, D = tok.shape[0], self.Hq, self.Hk, self.D
        x = self.embed(tok)                                                    # [n, h]
        cos, sin = self.rotary(x[:, None], pos[:, None])                       # [n, 1, D] each
        mask = attn.bool()[:, None, None, :]                                   # [n, 1, 1, L]
        for (norm1, qkv, o, scale, norm2, gate_up, down), la in zip(self.layers, cache.layers):
            q, k, v = qkv(_rms(x, norm1)).split([Hq * D, Hk * D, Hk * D], -1)  # [n, H*D]
            q, k = _rope(q.view(n, Hq, D), cos, sin), _rope(k.view(n, Hk, D), cos, sin)
            K, V = la.update(k[:, :, None], v.view(n, Hk, 1, D))               # [n, Hk, L, D]
            y = F.scaled_dot_product_attention(q.view(n, Hk, Hq // Hk, D), K, V, attn_mask=mask,
                                               scale=scale)                   # [n, Hk, Hq/Hk, D]
            x = x + o(y.reshape(n, Hq * D))
            g, u = gate_up(_rms(x, norm2)).chunk(2, -1)                        # [n, I] each
            x = x + down(F.silu(g) * u)
        return self.head(_rms(x, self.norm))                                   # [n, V]
