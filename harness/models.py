"""The model on disk: --model loaded with its tokenizer, the ids a response ends on, the final model
written.

Not an article section. `load_model` reads --model ('builtin', a folder such as OUT/final, or a hub
id) with its tokenizer, in float32 master weights; `end_ids` the token ids a response ends on (a
tokenizer and generation-config fact); `save_final` replaces OUT/final through checkpoint.atomic,
so that at every moment OUT/final or its aside copy OUT/final.old is a whole model.
"""
from __future__ import annotations

import json
import os

import torch

from harness.checkpoint import atomic, loadable
from infra.errors import InputError


def save_final(out: str, model, tokenizer, weights: dict, adapter=None) -> str:
    """OUT/final: the trained model (with `weights`: LoRA's merged, FSDP2's gathered) and its
    tokenizer, written atomically, in the dtype the model came in (`load_model`'s
    `source_dtype`: a 7B hub model in bfloat16 is saved in 15 GB, not float32's 30), config.json
    saying it; with `adapter` (a function writing LoRA's adapter alone into a folder), OUT/adapter
    beside it. Returns OUT/final."""
    final = os.path.join(out, "final")
    dtype = getattr(model, "source_dtype", None)
    if dtype is not None and weights is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    with atomic(final) as tmp:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        if dtype is not None:                    # save_pretrained writes the float32 masters'
            with open(os.path.join(tmp, "config.json"), encoding="utf-8") as fh:
                config = json.load(fh)
            config["dtype"] = str(dtype).removeprefix("torch.")
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(config, fh, indent=2, sort_keys=True)
    if adapter is not None:
        with atomic(os.path.join(out, "adapter")) as tmp:
            adapter(tmp)
    return final


def load_model(spec: str, trust_remote_code: bool = False):
    """(folder, tokenizer, model) for --model: 'builtin' (built and cached on first use), a folder
    or a hub id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    path = loadable(spec)  # OUT/final.old where a save was killed half way
    if spec == "builtin":
        from harness import builtin
        path = builtin.base_model()
    elif not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise InputError(f"--model {path}: no such folder")  # a path, not a hub id
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # float32 master weights whatever the checkpoint's dtype (most hub models are saved in
        # bfloat16, and transformers 5 keeps that dtype: AdamW updates of lr ~1e-6 would then mostly
        # round away); bf16 is the compute path, through autocast (--bf16)
        source = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
        # what save_final writes OUT/final in (None: a config without one, float32 kept)
        model.source_dtype = getattr(torch, source) if isinstance(source, str) else source
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0]
        raise InputError(f"--model {path}: could not be loaded ({why})") from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"--model {path}: the tokenizer has no EOS token, so responses could "
                         "never end")
    return path, tokenizer, model


def end_ids(tokenizer, model) -> list[int]:
    """The tokenizer's EOS, then any other end ids the model's generation config lists (as
    generate stops on them): some chat models end a turn with a token that is not the tokenizer's
    eos_token."""
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([tokenizer.eos_token_id, *extra]))
