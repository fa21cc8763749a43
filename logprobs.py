"""The training forward: log-probs and entropies of rollout responses under a model, each group's
prompt run once.

Article section: "Step 4: PPO Loss 计算" needs log pi_theta (with gradient), log pi_old and
log pi_ref of every response token; update.update_policy gets all three from `rollout_logprobs`.

Two layers:
- `token_logprobs` / `token_entropy`: from logits [N, T, V] to [N, T], over row blocks of
  infra/lm_head.py's chunk for the device (16 MB on CPU, 256 MB on a GPU), with their own
  backward. The reference they equal, in one line each, is
      logp = torch.log_softmax(logits / t, -1).gather(-1, ids[..., None]).squeeze(-1)
      entropy = -(logp_all.exp() * logp_all).sum(-1),  logp_all = torch.log_softmax(logits / t, -1)
  which autograd would run through three vocabulary-sized tensors;
  here the extra memory is one block.
- `rollout_logprobs`: the forward itself, a shared-prefix forward ("Prefix Grouper", arXiv
  2506.05433). All G responses of a group continue the same prompt, so the prompt's keys and values
  are computed once per group and attended by its G responses. `per_response_logprobs` is the plain
  form it replaces (every response with its own copy of the prompt),
  kept as the reference for tests and bench/.

How the shared-prefix forward is laid out (a cache, not packing: it runs on every attention kernel
and every transformers release this code supports, where a packed sequence needs a block mask
the kernels may not take):
  1. every prompt of the slice but its last token, left-padded to the slice's longest and run once
     per group into a DynamicCache (left padding keeps the prompt next to its response, as in
     sampling, so a sliding window counts the same distance,
     and position ids count from each prompt's first real token);
  2. the cache rows gathered to one per response, `cache.batch_select_indices(group of each row)`:
     an index, so it is differentiable and the prompt's activations get the
     gradient of all its responses;
  3. the responses, each fed as [last prompt token, its tokens but the last], run against that
     cache: T positions whose logits predict exactly the T response tokens (the last prompt token
     costs G times one token; this keeps the logits one contiguous [n, T, V] tensor).
A slice may cut a group (`--micro-batch-size` counts responses): its partial group's prompt is still
run once. Responses are trimmed to the slice's own longest response, not the rollout's. The gradient
equals the per-response one: the prompt's activations are the same function of the parameters,
reached by G paths. Cost of a pass: groups x P + n x T tokens instead of n x (P + T); it pays with
long prompts and short answers, and little with long reasoning traces (T >> P). With one process,
a slice whose response lengths are spread runs as up to four length buckets (`length_buckets`).
Under DDP the prompt runs on the wrapped module and the responses in one DDP forward (DDP syncs in
each forward, so every rank runs one per micro-batch); under FSDP2, or when gradient checkpointing
would drop the cache, the per-response forward runs instead (the caller says which:
`rollout_logprobs`' shared_prefix and buckets).
"""
from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from infra import lm_head
from infra.kv_cache import cache_kwarg, left_padded
from sampler import Rollout

# a slice's responses run in length buckets, each padded to its own longest: a bucket is cut in two
# when that leaves <= 80% of its positions, into at most MAX_BUCKETS (each a forward of its own)
BUCKET_KEEP = 0.8
MAX_BUCKETS = 4


# ---------------------------------------------------------------------------------------------
# The kernel: log softmax(logits / t)[ids] and the entropy, block by block
# ---------------------------------------------------------------------------------------------

def _row_blocks(x: torch.Tensor, rows: int):
    """Views [c, V] (c <= rows) tiling x [..., V] row by row in row-major order, never a copy.

    A contiguous x is split as one [rows, V] matrix; a sliced one (such as `.logits[:, :-1]`) is
    walked along its leading dimension, whose entries are contiguous.
    """
    if x.dim() <= 2 or x.is_contiguous():
        yield from x.reshape(-1, x.shape[-1]).split(rows)
    else:
        for sub in x.unbind(0):
            yield from _row_blocks(sub, rows)


def _softmax_blocks(logits: torch.Tensor, s: float, fn=torch.log_softmax):
    """(rows, fn(block * s)) over row blocks of logits [..., V], lm_head.chunk_rows' rows each.

    rows is a slice of the flattened row index; the [c, V] float32 result lives in a workspace
    allocated once and overwritten by the next block (a consumer may modify it in place), so a pass
    allocates nothing vocabulary-sized per block (on CPU a fresh block each time costs page faults
    and fragments the heap). fn: torch.log_softmax or softmax.
    """
    V = logits.shape[-1]
    n = min(lm_head.chunk_rows(V, logits.device), logits.numel() // max(V, 1))
    work = logits.new_empty(n, V, dtype=torch.float32)                        # [n, V]
    x = (logits.new_empty(n, V, dtype=torch.float32)
         if s != 1.0 or logits.dtype != torch.float32 else None)
    i = 0
    for b in _row_blocks(logits, max(n, 1)):                                  # b [c, V]
        c = b.shape[0]
        if x is not None:                                              # float32 block * s, in place
            b = x[:c].copy_(b) if s == 1.0 else x[:c].copy_(b).mul_(s)
        yield slice(i, i + c), fn(b, -1, out=work[:c])
        i += c


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(x * s)[id], block by block; autograd's own backward would build
    [N, T, V] three times."""

    @staticmethod
    def forward(ctx, logits, ids, s, kept):
        out, flat_ids = (logits.new_empty(ids.numel(), 1, dtype=torch.float32),
                         ids.reshape(-1, 1))  # [N*T, 1] each
        flat_kept = None if kept is None else kept.reshape(-1)               # [N*T], 0: all
        for rows, logp in _softmax_blocks(logits, s):
            torch.gather(logp, -1, flat_ids[rows], out=out[rows])
            cut = lm_head.truncated_rows(None if kept is None else flat_kept[rows], logp.shape[-1])
            if cut is not None:                                 # --top-p: under the nucleus
                out[rows][cut, 0] -= lm_head.kept_mass(logp[cut], flat_kept[rows][cut])
        ctx.save_for_backward(logits, ids, flat_kept)
        ctx.s = s
        return out.view(ids.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # d/dx_v log softmax(s x)_id = s (1[v = id] - softmax(s x)_v), written block by block into
        # the one gradient tensor: the only [N, T, V] this pass allocates.
        logits, ids, kept = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [N, T, V]
        flat, gs, flat_ids = (grad.view(-1, logits.shape[-1]), (g.float() * ctx.s).reshape(-1, 1),
                              ids.reshape(-1, 1))
        fn = torch.softmax if kept is None else torch.log_softmax
        for rows, p in _softmax_blocks(logits, ctx.s, fn):
            if kept is not None:                  # --top-p: the nucleus' softmax where it cut
                cut = lm_head.truncated_rows(kept[rows], p.shape[-1])
                inside = None if cut is None else lm_head.kept_probs(p[cut], kept[rows][cut])
                p = p.exp_()                                  # in the block's workspace: [c, V]
                if cut is not None:
                    p[cut] = inside
            torch.mul(p, -gs[rows], out=flat[rows]).scatter_add_(-1, flat_ids[rows],
                                                                 gs[rows].to(flat.dtype))
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   kept: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / temperature)[ids]: [N, T, V], [N, T] -> [N, T] float32,
    without a second [N, T, V].

    log_softmax then gather, over row blocks (lm_head.chunk_rows) in a float32 workspace (also
    for bf16 logits), so the extra memory is one block whatever N and T are; the logits may be a
    slice such as `.logits[:, :-1]` (no copy). The backward writes the gradient block by block: one
    [N, T, V] tensor, where autograd through log_softmax + gather makes three. Passing the
    temperature here rather than dividing the logits first saves another vocabulary-sized copy.
    kept [N, T] (Rollout.kept: --top-p's nucleus sizes, 0 for the full vocabulary): the log-prob
    under the token's kept most probable tokens renormalised, log p_id - log(their mass).
    """
    return _TokenLogprobs.apply(logits, ids, 1.0 / temperature, kept)


# log p of a masked (-inf) logit, so that p log p = 0 there
LOGP_FLOOR = torch.finfo(torch.float32).min


class _TokenEntropy(torch.autograd.Function):
    """-sum_v p_v log p_v of p = softmax(x * s), block by block, with a block-by-block backward."""

    @staticmethod
    def forward(ctx, logits, s):
        out, p = logits.new_empty(logits.shape[:-1], dtype=torch.float32).view(-1), None  # [N*T]
        for rows, logp in _softmax_blocks(logits, s):
            p = torch.empty_like(logp) if p is None else p                    # [c, V] workspace
            e = torch.exp(logp, out=p[: logp.shape[0]])                       # [c, V] p_v
            # a -inf logit: 0 * floor, not 0 * -inf = NaN
            out[rows] = -e.mul_(logp.clamp_min_(LOGP_FLOOR)).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.s = s
        return out.view(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # H = -sum_v p_v log p_v, p = softmax(z), z = s x: dH/dz_v = -p_v (log p_v + H), so
        # dH/dx_v = -s p_v (log p_v + H); one [N, T, V] gradient, the rest in the block workspace.
        logits, H = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [N, T, V]
        flat, gs, h, p = (grad.view(-1, logits.shape[-1]), (g.float() * ctx.s).reshape(-1, 1),
                          H.reshape(-1, 1), None)
        for rows, logp in _softmax_blocks(logits, ctx.s):
            p = torch.empty_like(logp) if p is None else p                    # [c, V] workspace
            e = torch.exp(logp, out=p[: logp.shape[0]])                       # [c, V] p_v
            # the block is ours to overwrite
            flat[rows] = logp.clamp_min_(LOGP_FLOOR).add_(h[rows]).mul_(e).mul_(-gs[rows])
        return grad, None


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the full next-token distribution softmax(logits / t),
    -sum_v p_v log p_v: [N, T, V] -> [N, T].

    The policy's real entropy, not the NLL of the sampled tokens (whose mean only estimates it).
    Differentiable (an entropy bonus in the loss gets its gradient) with one
    [N, T, V] tensor in the backward.
    """
    return _TokenEntropy.apply(logits, 1.0 / temperature)


# ---------------------------------------------------------------------------------------------
# The forward: each group's prompt once, its responses against the prompt's cache
# ---------------------------------------------------------------------------------------------

def _rows(roll: Rollout, rows: slice) -> tuple[int, int]:
    a, b, step = rows.indices(roll.response_ids.shape[0])
    if step != 1 or b <= a:
        raise ValueError(f"rows must be a non-empty contiguous slice of the "
                         f"{roll.response_ids.shape[0]} responses, got {rows}")
    return a, b


def _new_cache(model) -> DynamicCache:
    """An empty DynamicCache with the model's layer types (sliding-window layers too,
    transformers >= 4.56)."""
    cfg = model.config
    return (DynamicCache(config=cfg) if "config" in inspect.signature(DynamicCache).parameters
            else DynamicCache())


def length_buckets(lengths: torch.Tensor, max_buckets: int = MAX_BUCKETS) -> list[torch.Tensor]:
    """Rows [n] split by length into buckets (index tensors, shortest first), each to be padded to
    its own longest: a bucket is cut in two, at the cut that pads least, when that computes at most
    BUCKET_KEEP of its positions, the cut that saves most first, up to max_buckets."""
    order = lengths.sort(stable=True).indices                                  # [n] ascending
    buckets = [order]
    while len(buckets) < max_buckets:
        best = None                                                 # (positions saved, bucket, k)
        for i, rows in enumerate(buckets):
            L = lengths[rows]                                                  # [m] ascending
            m = L.shape[0]
            if m < 2:
                continue
            k = torch.arange(1, m)
            cost = k * L[:-1] + (m - k) * L[-1]                     # [m - 1] positions if cut at k
            c = int(cost.argmin())
            whole = m * int(L[-1])
            if float(cost[c]) <= BUCKET_KEEP * whole and (best is None
                                                          or whole - cost[c] > best[0]):
                best = (whole - int(cost[c]), i, c + 1)
        if best is None:
            break
        _, i, k = best
        buckets[i:i + 1] = [buckets[i][:k], buckets[i][k:]]
    return buckets if len(buckets) > 1 else [torch.arange(lengths.shape[0])]  # whole: in row order


def _cache_rows(cache: DynamicCache, index: torch.Tensor) -> DynamicCache:
    """A cache holding rows `index` of `cache`, which is left as it was (layers rebind, never write,
    their tensors). Differentiable: the prompts' gradient is the sum over their responses' rows.

    Gathered with index_select, whose backward is index_add_, not with transformers'
    `keys[index]`, whose backward is an accumulating index_put_: on the CPU that ran 3.5-4x slower
    for the gather and its gradient together (16 prompts x G = 8, 9 heads, 200 positions: 27 vs
    102 ms per tensor, once for the keys and once for the values of each layer)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:
        if (type(layer).batch_select_indices is DynamicLayer.batch_select_indices
                and layer.get_seq_length() > 0):                  # keys and values, nothing else
            layer.keys = layer.keys.index_select(0, index)         # [m, H, P-1, D]
            layer.values = layer.values.index_select(0, index)     # [m, H, P-1, D]
        else:                                                      # a layer that keeps more
            layer.batch_select_indices(index)
    return out


def scores(model, resp: torch.Tensor, temperature: float, with_entropy: bool,
           entropy_grad: bool, keep: int | None = None, kept: torch.Tensor | None = None,
           **inputs):
    """One forward of `model` on `inputs` -> (log-probs [m, T] of the response tokens resp [m, T],
    their entropies [m, T] or None). keep: logits_to_keep, the positions scored (T + 1 when the
    inputs end with the response; the last one predicts nothing). The LM head is fused with the
    log-softmax (infra/lm_head.py: no [m, T, V] tensor) where it can be; else the full logits and
    the block kernels above, the entropy without a graph unless entropy_grad. kept [m, T]:
    Rollout.kept's nucleus sizes (None: the full distribution)."""
    kw = {"logits_to_keep": keep} if keep else {}
    why = lm_head.fusable(model)
    if why is None:
        ids = torch.nn.functional.pad(resp, (0, 1)) if keep else resp       # [m, T(+1)]
        if kept is not None and keep:
            kept = torch.nn.functional.pad(kept, (0, 1))                     # [m, T+1]
        with lm_head.fused_head(model, ids, temperature, with_entropy, entropy_grad, kept):
            both = model(**inputs, **kw).logits                              # [m, T(+1), 2]
        both = both[:, :-1] if keep else both                                # [m, T, 2]
        return both[..., 0], (both[..., 1] if with_entropy else None)
    lm_head.warn_unfused(why)
    logits = model(**inputs, **kw).logits                                    # [m, T(+1), V]
    logits = logits[:, :-1] if keep else logits                              # [m, T, V]
    ent = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            ent = token_entropy(logits if entropy_grad else logits.detach(), temperature)
    return token_logprobs(logits, resp, temperature, kept), ent


def rollout_logprobs(model, roll: Rollout, rows: slice, temperature: float,
                     with_entropy: bool = False, shared_prefix: bool = True, buckets: bool = True,
                     entropy_grad: bool | None = None):
    """log pi(response token) of rollout rows [n, T] under `model` (float32), optionally the entropy
    [n, T], and the mask [n, T]; T is the rollout's width, values past a bucket's longest response
    are 0.

    The shared-prefix forward of the module docstring: each group's prompt once, its responses
    against it, in one to MAX_BUCKETS length buckets. Same values and gradients as
    `per_response_logprobs` (test_shared_prefix_forward_equals_per_response). The caller says how it
    may run (update.update_policy): shared_prefix=False runs `per_response_logprobs` instead (FSDP2,
    which all-gathers in every forward so that ranks must run one forward per micro-batch as a
    zero-weight pass does; gradient checkpointing with gradients, whose recompute transformers runs
    without the cache); buckets=False keeps one bucket (DDP, which syncs in each of its forwards:
    one per micro-batch on every rank). entropy_grad: whether the entropy is differentiated (the
    --entropy-coef bonus); None: when it is asked for.
    """
    a, b = _rows(roll, rows)
    entropy_grad = with_entropy if entropy_grad is None else entropy_grad
    if not shared_prefix:
        return per_response_logprobs(model, roll, rows, temperature, with_entropy, entropy_grad)
    inner = getattr(model, "module", model)                          # under DDP, the wrapped model
    G, dev = roll.G, next(model.parameters()).device
    T_all = roll.response_ids.shape[1]
    g0 = a // G
    prompts = roll.prompts[g0:(b - 1) // G + 1]                      # each group met by the slice
    group = torch.arange(a, b) // G - g0                             # [n] row -> its prompt
    plen = torch.tensor([len(p) for p in prompts])                   # [g]
    last = torch.tensor([p[-1] for p in prompts])                    # [g] each prompt's last token
    cache, name = None, cache_kwarg(inner)
    if int(plen.max()) > 1:                                         # 1. the prompts, once per group
        head_ids, head_mask = left_padded([p[:-1] for p in prompts], roll.pad_token_id)  # [g, P-1]
        head_pos = (head_mask.cumsum(-1) - 1).clamp_min(0)           # [g, P-1] from the first token
        cache = _new_cache(inner)
        # run outside DDP's forward: DDP broadcasts buffers in each forward, so a second DDP forward
        # per micro-batch would hang ranks that run a zero-weight pass; the prompt's gradient still
        # reaches the parameters' DDP hooks, which fire once per backward with both paths summed
        inner(input_ids=head_ids.to(dev), attention_mask=head_mask.to(dev),
              position_ids=head_pos.to(dev), use_cache=True, logits_to_keep=1, **{name: cache})
    out, order = [], []
    parts = length_buckets(roll.lengths[a:b].cpu()) if buckets else [torch.arange(b - a)]
    for r in parts:                                                  # rows r [m]
        T = int(roll.lengths[a:b][r].max())                         # this bucket's longest response
        resp = roll.response_ids[a:b][r, :T].cpu()                   # [m, T]
        ids = torch.cat([last[group[r], None], resp[:, :T - 1]], 1)  # [m, T] the rows' inputs
        pos = plen[group[r], None] - 1 + torch.arange(T)           # [m, T] going on from the prompt
        kw, attn = {"use_cache": False}, torch.ones(ids.shape, dtype=torch.long)  # [m, T]
        if cache is not None:                                        # 2. one cache row per response
            kw = {name: _cache_rows(cache, group[r].to(dev)), "use_cache": True}
            attn = torch.cat([head_mask[group[r]], attn], 1)         # [m, P-1 + T]
        kept = None if roll.kept is None else roll.kept[a:b][r, :T].to(dev)  # [m, T]
        lp, ent = scores(model, resp.to(dev), temperature, with_entropy, entropy_grad,  # 3.
                         kept=kept, input_ids=ids.to(dev), attention_mask=attn.to(dev),
                         position_ids=pos.to(dev), **kw)             # [m, T] each
        pad = lambda x, T=T: torch.nn.functional.pad(x, (0, T_all - T))  # noqa: E731  -> [m, T_all]
        out.append((pad(lp), pad(ent) if with_entropy else None))
        order.append(r)
    back = torch.cat(order).argsort().to(dev)                        # [n] bucket order -> row order
    logp = torch.cat([lp for lp, _ in out])[back]                    # [n, T_all]
    ent = torch.cat([e for _, e in out])[back] if with_entropy else None  # [n, T_all]
    return logp, ent, roll.mask[a:b].to(dev)


def own_prompt_inputs(roll: Rollout, a: int, b: int, dev):
    """Rows a:b as per_response_logprobs feeds them: (input_ids, attention_mask, position_ids)
    [n, P+T] each on dev, and the responses [n, T], T the rows' longest: each response after its
    own left-padded prompt, right-padded (pads after EOS are masked by the loss)."""
    T = int(roll.lengths[a:b].max())                                          # the slice's longest
    resp = roll.response_ids[a:b, :T].cpu()                                   # [n, T]
    pids, pmask = left_padded([roll.prompts[i // roll.G] for i in range(a, b)], roll.pad_token_id)
    ids = torch.cat([pids, resp], 1).to(dev)                                  # [n, P+T]
    attn = torch.cat([pmask, torch.ones(b - a, T, dtype=torch.long)], 1).to(dev)  # [n, P+T]
    pos = (attn.cumsum(-1) - 1).clamp_min(0)                                  # [n, P+T]
    return ids, attn, pos, resp.to(dev)


def per_response_logprobs(model, roll: Rollout, rows: slice, temperature: float,
                          with_entropy: bool = False, entropy_grad: bool | None = None):
    """The plain form of `rollout_logprobs` (same arguments and results): every response with its
    own copy of the prompt, left-padded prompt + response right-padded to the slice's longest
    response (values past it are 0), in one forward without a KV cache. Only the last T + 1
    positions are scored (logits_to_keep), of those the T that predict the response. The
    reference in tests and bench/; the trainer runs it under FSDP2 and gradient checkpointing.
    """
    a, b = _rows(roll, rows)
    entropy_grad = with_entropy if entropy_grad is None else entropy_grad
    dev = next(model.parameters()).device
    ids, attn, pos, resp = own_prompt_inputs(roll, a, b, dev)                # [n, P+T], [n, T]
    T_all, T = roll.response_ids.shape[1], resp.shape[1]                     # rollout's, slice's
    kept = None if roll.kept is None else roll.kept[a:b, :T].to(dev)        # [n, T]
    logp, ent = scores(model, resp, temperature, with_entropy, entropy_grad, keep=T + 1,
                       kept=kept, input_ids=ids, attention_mask=attn, position_ids=pos,
                       use_cache=False)
    pad = lambda x: torch.nn.functional.pad(x, (0, T_all - T))  # noqa: E731  [n, T] -> [n, T_all]
    return pad(logp), (pad(ent) if with_entropy else None), roll.mask[a:b].to(dev)
