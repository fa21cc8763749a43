"""The built-in base model's warm start: one supervised step of demonstrations packed into rows vs
padded to the longest (here, not in harness/builtin.py: it measures the build, not the loop).

Not an article section: harness/builtin.py's warm start (`warm_start_batches`), timed both ways.

    python -m bench --only warmstart --threads 0   # on all cores, as harness/builtin.py builds
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.common import sync


def _padded(ids, pos, labels):
    """The same demonstrations as a packed batch, one per row, padded to the longest (the unpacked
    form)."""
    seqs = []
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        seqs += [(ids[r, a:b], labels[r, a:b]) for a, b in zip(starts, starts[1:])
                 if (labels[r, a:b] != -100).any()]
    T = max(len(s) for s, _ in seqs)
    out = (torch.zeros(len(seqs), T, dtype=torch.long), torch.full((len(seqs), T), -100),
           torch.zeros(len(seqs), T, dtype=torch.long))
    for i, (s, lab) in enumerate(seqs):
        out[0][i, :len(s)], out[1][i, :len(s)], out[2][i, :len(s)] = s, lab, 1
    return out  # input_ids, labels, attention_mask: [B, T] each


def bench_warm_start(device: str, repeats: int, steps: int = 6) -> None:
    import dataclasses

    from harness import builtin
    cfg = dataclasses.replace(builtin.BaseModelConfig(), sft_steps=steps * repeats + 2)
    tok = builtin.make_tokenizer()
    model = builtin.make_model(cfg, len(tok)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = builtin.warm_start_batches(tok, cfg)

    def step(b, packed: bool):
        ids, pos, labels = b
        if packed:
            logits = model(input_ids=ids.to(device), position_ids=pos.to(device),
                           use_cache=False).logits
        else:
            ids, labels, attn = _padded(ids, pos, labels)
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device),
                           use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten().to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return ids.numel()

    step(batches[0], True), step(batches[1], False)  # warm-up
    times, tokens = {True: [], False: []}, {True: [], False: []}
    for b in batches[2:]:
        for packed in (True, False):  # interleaved, on the same batch
            t0 = time.perf_counter()
            tokens[packed].append(step(b, packed))
            sync(device)
            times[packed].append(time.perf_counter() - t0)
    # demonstrations hold no <pad>
    real = statistics.mean(int((b[0] != tok.pad_token_id).sum()) for b in batches[2:])
    print(f"\n## The built-in warm start: one step of {cfg.sft_batch_size} demonstrations, packed "
          f"vs padded (median of {len(batches) - 2} steps, interleaved)")
    full = builtin.BaseModelConfig().sft_steps
    for packed, name in ((False, "padded to the longest (attention mask)"),
                         (True, f"packed into rows of <= {cfg.sft_pack_len} tokens")):
        med = statistics.median(times[packed])
        print(f"  {name:44s} {med * 1e3:7.1f} ms/step   {statistics.mean(tokens[packed]):6.0f} "
              f"positions ({real:.0f} real)   x {full} steps = {med * full:5.0f} s")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"  packed / padded time: {ratio:.2f}")
