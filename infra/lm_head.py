"""The LM head fused with the log-softmax: log-probs and entropies of the response tokens from the
last hidden states, a chunk of rows at a time, so no [n, T, V] logits tensor exists on any path.

Article section: "Step 4: PPO Loss 计算" (log pi_theta, log pi_old and log pi_ref of each response
token; logprobs.py is the forward that asks for them, this is how they are computed at V = 151,936).

The model runs as usual, but for the call its output layer (`get_output_embeddings()`, an nn.Linear)
returns [n, T, 2] (the token's log-prob and the distribution's entropy) instead of its [n, T, V]
logits. Inside, `_FusedHead` walks the rows in chunks of `head_chunk_rows(V, H, device)`: logits of
the chunk (x W^T + b in the caller's autocast dtype, W cast once per pass), log-softmax in float32,
the token's entry and the entropy; backward recomputes each chunk's logits (the fused linear +
log-softmax that Liger and verl use) and accumulates the gradients of the hidden states, W and b
(in place, float32; none for a frozen W or b). What stays alive between forward
and backward is the hidden states (already held by the model's graph) and two floats per token. The
entropy gets a gradient only where the caller asks (the --entropy-coef bonus); else its backward
term is skipped.

Because the head runs inside the model's own forward, it composes with DDP (the call goes through
DDP's forward), FSDP2 (the head's weight is the gathered one during the forward and backward) and
peft. Heads that are not a plain linear, or models that transform the logits after it (final
logit soft-capping, a logit scale), are not fused: `fusable` says why and logprobs.py falls back to
the full logits (one warning).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

# elements (rows x V) of one chunk's float32 logits: 16 MB on CPU (cache-sized), 256 MB on an
# accelerator (441 rows at V = 151,936: a few hundred launches per pass, not thousands)
CHUNK_ELEMENTS = {"cpu": 1 << 22}
CHUNK_ELEMENTS_ACCEL = 1 << 26
# config fields that transform the logits after the head: the fused path would skip them
POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_WARNED: set = set()


def nucleus_last(cdf: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus' last index in descending order: cdf [n, V] the running mass of the sorted
    probabilities -> [n, 1], the first index whose mass reaches top_p of the total (the smallest set
    holding top_p); the one top-p rule: sampler.sample_token draws under it and nucleus_size
    recomputes it."""
    return torch.searchsorted(cdf, top_p * cdf[:, -1:]).clamp_max(cdf.shape[-1] - 1)


def chunk_rows(V: int, device: torch.device) -> int:
    """Rows per chunk: the device's element budget over the vocabulary, at least one."""
    budget = CHUNK_ELEMENTS.get(torch.device(device).type, CHUNK_ELEMENTS_ACCEL)
    return max(1, budget // max(V, 1))


def head_chunk_rows(V: int, H: int, device: torch.device) -> int:
    """Rows per chunk of the fused head's passes: chunk_rows on CPU; on an accelerator at least
    H / 2, so a chunk's float32 logits are as large as the bf16 [V, H] weight: each chunk moves
    12 V H bytes of [V, H] traffic (the bf16 weight read by two matmuls, float32 dW read and
    written) for 6 c V H FLOPs, c / 2 FLOPs a byte, past an H100's ~300 from c = 600 rows (441 rows
    at V = 151,936 were under it); the chunk's transients, ~4.5 float32 [c, V], stay ~9 V H
    bytes."""
    rows = chunk_rows(V, device)
    return rows if torch.device(device).type == "cpu" else max(rows, H // 2)


def output_layer(model):
    """The model's LM head module (through DDP's `.module` and peft's wrappers)."""
    inner = getattr(model, "module", model)
    return inner.get_output_embeddings()


def fusable(model) -> str | None:
    """None when the head can be fused, else why not (one line)."""
    head = output_layer(model)
    if not isinstance(head, torch.nn.Linear):
        return f"the output layer is a {type(head).__name__}, not a plain nn.Linear"
    cfg = getattr(getattr(model, "module", model), "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for name in POST_HEAD:
        value = getattr(cfg, name, None)
        if value not in (None, 0, 0.0, 1, 1.0, False):
            return f"the model's config sets {name}={value} after the head"
    return None


class Fp32Linear(torch.nn.Linear):
    """--fp32-lm-head: an output layer whose matmul runs in float32 outside autocast, for every
    caller (the sampler's decode steps, evaluation, the fused head below, the plain fallback), as
    MiniMax-M1, ScaleRL and TRL's cast_lm_head_to_fp32 do under bf16. Parameters and state dict
    are the nn.Linear's; only the class changes (`run_in_fp32`), so copies keep it."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def run_in_fp32(model) -> None:
    """The model's output layer (a plain nn.Linear) computes its logits in float32 from now on."""
    head = output_layer(model)
    if type(head) is not torch.nn.Linear and not isinstance(head, Fp32Linear):
        raise ValueError(f"--fp32-lm-head: the output layer is a {type(head).__name__}, not a "
                         f"plain nn.Linear")
    head.__class__ = Fp32Linear


def warn_unfused(why: str) -> None:
    """One warning per reason: the full [n, T, V] logits are built instead."""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"the LM head is not fused with the log-softmax ({why}); the training "
                      f"forward builds the full [n, T, V] logits", stacklevel=3)


def kept_mass(logp: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log of the mass of each row's kept[i] most probable tokens: logp [c, V] log-softmax rows,
    kept [c] long counts in [1, V] -> [c] (<= 0). Subtracted from a token's log-prob, it gives the
    log-prob under the nucleus it was drawn from (--top-p: the sampler records the count). Only the
    largest count's top entries are ordered (topk, not a sort of V)."""
    top = logp.topk(int(kept.max()), -1, sorted=True).values                 # [c, k]
    return top.logcumsumexp(-1).gather(-1, kept[:, None] - 1).squeeze(-1)


def kept_probs(logp: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The distribution restricted to each row's kept[i] most probable tokens and renormalised:
    [c, V] (zeros outside the nucleus), the softmax whose gradient kept_mass' log-prob has."""
    top, order = logp.topk(int(kept.max()), -1, sorted=True)                 # [c, k] each
    lse = top.logcumsumexp(-1).gather(-1, kept[:, None] - 1)                 # [c, 1]
    inside = torch.arange(top.shape[-1], device=logp.device) < kept[:, None]  # [c, k] sorted
    p = (top - lse).exp_().mul_(inside)
    return torch.zeros_like(logp).scatter_(-1, order, p)


def truncated_rows(kept: torch.Tensor | None, V: int) -> torch.Tensor | None:
    """The rows [r] of kept [N] (0: the full vocabulary) whose nucleus leaves tokens out, or None
    when none does (then nothing sorts)."""
    if kept is None:
        return None
    rows = ((kept > 0) & (kept < V)).nonzero().squeeze(-1)
    return rows if rows.numel() else None


def nucleus_size(logp: torch.Tensor, ids: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus top_p keeps, as a count: logp [c, V] log-softmax rows, ids [c] the tokens drawn
    -> [c] long, the smallest number of most probable tokens whose mass reaches top_p (the
    sampler's rule), raised where needed to hold the token drawn (an engine's nucleus can differ
    from ours at its edge by the kernels' rounding)."""
    cdf = logp.sort(dim=-1, descending=True).values.exp_().cumsum_(-1)    # [c, V]
    k = nucleus_last(cdf, top_p).squeeze(-1) + 1                   # [c]
    rank = (logp > logp.gather(-1, ids[:, None])).sum(-1)                 # [c] tokens ahead of it
    return torch.maximum(k, rank + 1)


@contextlib.contextmanager
def sizes_head(model, ids: torch.Tensor, temperature: float, top_p: float):
    """For the calls in the block (no gradient), the model's output layer returns [n, T, 1]: the
    size of the nucleus at top_p of softmax(logits / temperature) that holds each of ids [n, T]
    (nucleus_size), chunk by chunk as the fused head, so no [n, T, V] tensor exists."""
    head = output_layer(model)
    fp32 = isinstance(head, Fp32Linear)

    def forward(hidden):                                                     # [n, T, H]
        dev = hidden.device.type
        amp = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev) and not fp32)
        h = (hidden.float() if fp32 else hidden).reshape(-1, hidden.shape[-1])  # [N, H]
        flat_ids, out = ids.to(hidden.device).reshape(-1), []                  # [N]
        rows = chunk_rows(head.weight.shape[0], hidden.device)
        w, b = _compute_weights(head.weight, head.bias, h, amp)       # cast once, not per chunk
        for a in range(0, h.shape[0], rows):
            z = _chunk_logits(h[a:a + rows], w, b, 1.0 / temperature)
            out.append(nucleus_size(torch.log_softmax(z, -1), flat_ids[a:a + rows], top_p))
        return torch.cat(out).view(*ids.shape, 1)
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _compute_weights(weight, bias, h, amp):
    """(weight, bias) in the dtype the head's matmuls run in under the autocast state `amp`
    (device, dtype, on), else h's: cast once per pass (autocast casts a frozen weight again at
    every use, and in backward, outside the forward's autocast region, any weight at every
    chunk); no copy where the dtype is already that one."""
    cdt = amp[1] if amp[2] else h.dtype
    return weight.to(cdt), None if bias is None else bias.to(cdt)


def _chunk_logits(h, weight, bias, s: float) -> torch.Tensor:
    """float32 logits * s of rows h [c, H], in the dtype of weight (_compute_weights), whatever
    autocast the caller is in."""
    with torch.autocast(h.device.type, enabled=False):
        z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias)      # [c, V]
    return z.float().mul_(s) if s != 1.0 else z.float()


def _accumulate(dW: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """dW [V, H] float32 += a @ b in place, no [V, H] temporary: bf16/fp16 operands on CUDA
    accumulate into float32 (out_dtype), elsewhere they are widened to float32 (the same values:
    a bf16 GEMM accumulates in float32 too)."""
    if a.dtype == dW.dtype:
        dW.addmm_(a, b)
    elif dW.device.type == "cuda":
        torch.addmm(dW, a, b, out_dtype=dW.dtype, out=dW)
    else:
        dW.addmm_(a.to(dW.dtype), b.to(dW.dtype))


class _FusedHead(torch.autograd.Function):
    """[n, T, H] hidden states -> [n, T, 2] (log softmax(s z)[id], entropy of softmax(s z)),
    z = h W^T + b, chunk by chunk; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, kept, s, want_entropy, entropy_grad, fp32):
        dev = hidden.device.type                      # fp32: --fp32-lm-head, autocast off
        amp = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev) and not fp32)
        ctx.in_dtype = hidden.dtype
        hidden = hidden.float() if fp32 else hidden
        H, V = hidden.shape[-1], weight.shape[0]
        h, flat_ids = hidden.reshape(-1, H), ids.reshape(-1, 1)              # [N, H], [N, 1]
        kept = None if kept is None else kept.reshape(-1)                    # [N], 0: all of V
        out = hidden.new_zeros(h.shape[0], 2, dtype=torch.float32)           # [N, 2]
        rows = head_chunk_rows(V, H, hidden.device)
        w, b = _compute_weights(weight, bias, h, amp)                 # cast once, not per chunk
        for a in range(0, h.shape[0], rows):
            logp = torch.log_softmax(_chunk_logits(h[a:a + rows], w, b, s), -1)
            out[a:a + rows, 0] = logp.gather(-1, flat_ids[a:a + rows]).squeeze(-1)
            cut = truncated_rows(None if kept is None else kept[a:a + rows], V)  # [r] top-p rows
            if cut is not None:                                # under the nucleus drawn from
                out[a + cut, 0] -= kept_mass(logp[cut], kept[a + cut])
            if want_entropy:                                                 # -sum p log p
                out[a:a + rows, 1] = -(logp.exp() * logp.clamp_min(_FLOOR)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, ids, kept, out)
        ctx.s, ctx.amp, ctx.entropy_grad, ctx.has_bias = s, amp, entropy_grad, bias is not None
        return out.view(*ids.shape, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # per row, with p = softmax(s z): d logp_id / dz_v = s (1[v = id] - p_v) and
        # dH / dz_v = -s p_v (log p_v + H); chunk by chunk, the logits' gradient dz [c, V] is
        # multiplied out into dh = dz W and dW = dz^T h, db = sum dz
        hidden, weight, bias, ids, kept, out = ctx.saved_tensors
        H, V = hidden.shape[-1], weight.shape[0]
        h, flat_ids, g = hidden.reshape(-1, H), ids.reshape(-1, 1), g.reshape(-1, 2).float()
        dh = torch.empty_like(h)                                             # [N, H]
        # no dW, db for a frozen head (--lora-r): 4 V H bytes and a matmul per chunk saved
        want_w = ctx.needs_input_grad[1]
        want_b = ctx.has_bias and ctx.needs_input_grad[2]
        dW = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V, H]
              if want_w else None)
        db = torch.zeros(V, dtype=torch.float32, device=weight.device) if want_b else None
        w, b = _compute_weights(weight, bias, h, ctx.amp)             # cast once per backward
        cdt = w.dtype                                                        # the matmuls' dtype
        rows = head_chunk_rows(V, H, hidden.device)
        for a in range(0, h.shape[0], rows):
            hc, gl = h[a:a + rows], g[a:a + rows, :1]                        # [c, H], [c, 1]
            logp = torch.log_softmax(_chunk_logits(hc, w, b, ctx.s), -1)
            p = logp.exp()                                                   # [c, V]
            dz = p.mul(-gl)                                                  # logp's term
            cut = truncated_rows(None if kept is None else kept[a:a + rows], V)
            if cut is not None:                     # its softmax over the nucleus (--top-p)
                dz[cut] = kept_probs(logp[cut], kept[a + cut]).mul_(-gl[cut])
            dz.scatter_add_(-1, flat_ids[a:a + rows], gl)
            if ctx.entropy_grad:                                             # the entropy's term
                ge, Hc = g[a:a + rows, 1:], out[a:a + rows, 1:]              # [c, 1] each
                dz -= p * (logp.clamp_min(_FLOOR) + Hc) * ge
            dz = dz.mul_(ctx.s).to(cdt)                                      # [c, V] d/d(logits)
            dh[a:a + rows] = (dz @ w).to(dh.dtype)
            if dW is not None:
                _accumulate(dW, dz.t(), hc.to(cdt))                          # [V, H]
            if db is not None:
                db += dz.float().sum(0)
        return (dh.view(hidden.shape).to(ctx.in_dtype),
                None if dW is None else dW.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None, None)


_FLOOR = torch.finfo(torch.float32).min   # log p of a -inf logit, so that p log p = 0 there


@contextlib.contextmanager
def fused_head(model, ids: torch.Tensor, temperature: float, want_entropy: bool,
               entropy_grad: bool, kept: torch.Tensor | None = None):
    """For the calls in the block, the model's output layer returns [n, T, 2] (log-prob of ids
    [n, T] under softmax(logits / temperature), its entropy (zeros unless want_entropy)) in place of
    the logits; the entropy has a gradient only with entropy_grad. kept [n, T] (the sampler's
    nucleus sizes, 0: the full vocabulary): each log-prob under its token's kept most probable
    tokens renormalised; the entropy stays the full distribution's."""
    head = output_layer(model)
    fp32 = isinstance(head, Fp32Linear)

    def forward(hidden):                                                     # [n, T, H]
        return _FusedHead.apply(hidden, head.weight, head.bias, ids.to(hidden.device),
                                None if kept is None else kept.to(hidden.device),
                                1.0 / temperature, want_entropy, entropy_grad, fp32)
    head.forward = forward                               # an instance attribute, removed after
    try:
        yield
    finally:
        del head.forward
