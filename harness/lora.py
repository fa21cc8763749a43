"""LoRA through peft (`--lora-r R`): only low-rank adapters train, the reference of the KL term is
the same model with its adapters off, and the final model is saved merged,
with the adapter alone beside it.

Not an article section: a way to train the article's policy (Step 4's update)
with a fraction of the state.

    python train.py --lora-r 16                                   # built-in task
    torchrun --standalone --nproc_per_node 8 train.py --lora-r 64 \\
        --model Qwen/Qwen2.5-7B-Instruct --data train.jsonl

The adapters are injected in place (peft.inject_adapter_in_model), so the model stays the
transformers class the sampler, the training forward, DDP and save_pretrained already handle. Each
adapted linear layer computes W x + (alpha / r) B A x with A [r, in] random and B [out, r] zero at
the start, so the first policy is the base model. Base weights are frozen and AdamW holds only A and
B; with beta > 0 the reference log-probs come from the same weights with the adapters switched off
(`adapters_off`), so there is no second copy of the model. peft is imported only here;
without it --lora-r stops with one line.
"""
from __future__ import annotations

import contextlib
import os

import torch

from infra.errors import InputError

# the attention and MLP projections of Llama, Qwen2/2.5/3 and Mistral (and most decoders named like
# them)
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ADAPTER = "default"                                   # peft's name for the one adapter


def _peft():
    try:
        import peft
    except ImportError:
        raise InputError("--lora-r: the peft package is not installed (pip install peft)") from None
    return peft


def _layers(model) -> dict[str, torch.nn.Module]:
    """The adapted layers by module name (peft's BaseTunerLayer: the
    wrapped linear and its A, B)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def add_adapters(model, r: int, alpha: float, targets: str, base_path: str):
    """Inject LoRA adapters of rank r into the `targets` modules (comma-separated names, or
    'all-linear') in place and freeze everything else; returns the peft LoraConfig
    (saved with the adapter)."""
    peft = _peft()
    names = (targets if targets == "all-linear"
             else [t.strip() for t in targets.split(",") if t.strip()])
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=names,
                             bias="none",
                             task_type="CAUSAL_LM", base_model_name_or_path=base_path)
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: none of the target modules is in the model
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise InputError(f"--lora-target-modules {targets}: {str(e).splitlines()[0][:120]} (linear "
                         f"layers: {', '.join(linear)})") from None
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    return config


@contextlib.contextmanager
def adapters_off(model):
    """The base model's forward: every adapter switched off inside (the KL term's
    reference), on again after."""
    layers = _layers(model).values()
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            # peft: also marks the adapters trainable again, as they were
            m.enable_adapters(True)


def has_adapters(model) -> bool:
    """Whether --lora-r's adapters are in the model (peft is then installed)."""
    return any(".lora_" in n for n, _ in model.named_parameters())


def merged_weights(model, dtype: torch.dtype | None = None):
    """(name, tensor) for each entry of the base model's state dict, lazily, one at a time, each
    adapted weight W + (alpha / r) B A (summed in W's dtype), in `dtype` (None: as they are). An
    engine reading the stream (--rollout vllm's push) holds one merged weight at a time, never all
    of them (a 7B model at r 64: ~26 GB). The model itself is left as it is."""
    layers = _layers(model)
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        name = k.removesuffix(".base_layer.weight")
        if name != k and name in layers:
            with torch.no_grad():
                v = v + layers[name].get_delta_weight(ADAPTER).to(v.dtype)   # [out, in]
        yield k.replace(".base_layer.", "."), v.detach() if dtype is None else v.detach().to(dtype)


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapted weight replaced by W + (alpha / r) B A: what
    AutoModelForCausalLM loads as a plain model (merged_weights, all at once)."""
    return dict(merged_weights(model))


def save_adapter(model, config, folder: str) -> None:
    """The adapter alone in peft's format (adapter_config.json, adapter_model.safetensors), loadable
    with peft.PeftModel.from_pretrained(base model, folder)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    weights = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    save_file({f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in weights.items()},
              os.path.join(folder, "adapter_model.safetensors"))
    config.save_pretrained(folder)
