"""The rollout's matmuls on CPU through weights packed once by oneDNN (float32), not MKL's sgemm on
the nn.Linear weights as stored.

Article section: "Step 1: Rollout 采样" (the old policy decodes its G answers; this is how its
matrix multiplies run on a CPU, not what is sampled).

A decode step multiplies a few rows (the slots still decoding, 1 to --max-num-seqs) by every weight
of the model. Through torch's nn.Linear that is an sgemm with a transposed right side, which MKL
runs at a fraction of the CPU's rate at those row counts (the vocabulary projection of the 38.9M
Qwen2, 12 rows: 11.5 ms; the same reordered by oneDNN: 4.0 ms). oneDNN's blocked layout serves any
row count, so the weights are reordered once per rollout (a copy of the model's Linear weights, 0.1
s for 39M parameters) and the copy is dropped after: the update changes the weights, and the next
rollout packs them again. The rollout is the one the plain weights give up to float rounding (the
sums run in another order): `test_packed_weights_give_the_plain_rollout` holds it to 1e-5 in the
log-probs.

`packed_linears` is the context sampler.sample_groups decodes in; `can_pack` says where it applies:
a CPU whose torch has oneDNN, float32 weights held as plain tensors (not FSDP2's sharded ones),
autocast off (under --bf16 autocast the matmuls are autocast's), and only the weights of MIN_WEIGHT
elements or more (the built-in model's are all smaller: its rollouts multiply as before).
"""
from __future__ import annotations

import contextlib

import torch

# the smallest weight packed, in elements: below it oneDNN's call costs more than it saves (the
# built-in model, hidden 128: its largest weight 49,152, a 256-row rollout 0.56 s packed vs 0.49 s
# plain; the 38.9M Qwen2's smallest, k and v, 512 x 128, run faster packed from 4 rows)
MIN_WEIGHT = 1 << 16


def linears(model) -> list[torch.nn.Linear]:
    """The model's nn.Linear modules of at least MIN_WEIGHT weights (LoRA's adapters and the layers
    they wrap included, each by its size)."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.numel() >= MIN_WEIGHT]


def can_pack(model) -> bool:
    """Whether packed_linears applies: some Linear of MIN_WEIGHT, every one a plain float32 CPU
    tensor, oneDNN in this torch, CPU autocast off."""
    ws = [m.weight for m in linears(model)]
    return (bool(ws) and torch.backends.mkldnn.is_available()
            and not torch.is_autocast_enabled("cpu")
            and all(type(w) is torch.nn.Parameter and w.device.type == "cpu"
                    and w.dtype == torch.float32 for w in ws))


def packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """A Linear's forward on its weight [out, in] reordered by oneDNN for inputs of about `rows`
    rows (any row count runs; the layout is chosen for that one)."""
    w = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)      # oneDNN's layout
    b = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:                 # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return forward


@contextlib.contextmanager
def packed_linears(model, rows: int, enabled: bool = True):
    """Within the block, every nn.Linear of the model multiplies through its weight packed on
    entry (no gradient: a rollout's forward); its own forward is back on exit, the packed copy
    freed. enabled=False, or where can_pack says no: the model as it is."""
    if not (enabled and can_pack(model)):
        yield False
        return
    mods = linears(model)
    own = [m.__dict__.get("forward") for m in mods]        # an instance forward someone set
    for m in mods:
        m.forward = packed_forward(m.weight, m.bias, rows)
    try:
        yield True
    finally:
        for m, f in zip(mods, own):
            del m.forward
            if f is not None:
                m.forward = f
