"""Data parallel training over torchrun's ranks: DDP (every rank holds the whole model) or FSDP2
(`--fsdp`, parameters, gradients and AdamW state sharded over the ranks).

Not an article section: the machinery that lets the loop of train.py run unchanged on N GPUs.

    torchrun --standalone --nproc_per_node 8 train.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --data train.jsonl                     # DDP
    torchrun --standalone --nproc_per_node 8 train.py --fsdp \\
        --model Qwen/Qwen2.5-7B-Instruct --data train.jsonl                       # FSDP2

- `Dist`: rank, world size, device and the three collectives the loop needs (sum, max, gather).
  Without torchrun's environment nothing distributed happens (except `--fsdp`, which
  shards over a 1-rank group).
- `wrap` / `shard`: DDP, or `torch.distributed.fsdp.fully_shard` on each decoder layer, then the
  root; on CUDA with bf16 parameters for compute and float32 gradient reductions (the sharded master
  weights and AdamW stay float32), on CPU plain float32.
- `grad_sync`: DDP skips the gradient all-reduce on all but the last micro-batch of an update. FSDP2
  reduce-scatters after every micro-batch instead: its no-sync mode
  (`set_requires_gradient_sync(False)`) would keep an unsharded float32 gradient of the whole model
  on every rank (4 bytes per parameter, the memory sharding exists to save),
  so it trades one reduce-scatter per micro-batch for that memory.
- `unsharded`: FSDP2 all-gathers a layer's weights before each forward and frees them after.
  Decoding token by token would then all-gather every layer once per token, and since ranks decode
  different numbers of tokens (responses end early, evaluation rows differ) their collectives would
  not even match up. The rollout and evaluation (and the no-grad log-prob passes) run inside
  `unsharded`: one all-gather of the whole model before, none during, a reshard after. The full
  weights (bf16 on CUDA) then sit on every rank for that while:
  2 bytes per parameter on top of the sharded state.
- `full_state_dict`: the whole model's weights gathered on rank 0 (in CPU
memory), for `save_pretrained`.
- `checkpoint_activations` (`--gradient-checkpointing`): transformers' non-reentrant activation
  checkpointing, each decoder layer's activations recomputed in backward instead
  of kept from the forward.
- `clock`: the time at a phase boundary (time/*_s, perf/mfu_*), read after `sync`: CUDA runs
  kernels asynchronously, so a clock read without it charges a phase's queued work to the next.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
import time

import torch
import torch.distributed as dist

# DDP's constructor imports torch.distributed.nn, whose functions take group.WORLD as a default
# argument. Imported after init_process_group, those defaults pin the process group, so
# destroy_process_group cannot free it and its gloo threads run on into interpreter exit (where a
# rank aborted in CI). Imported here, before any process group exists, the defaults are None.
# (Inside a function, `import torch.distributed.nn` would also make `torch` a local name there:
# pyflakes F823.)
import torch.distributed.nn  # noqa: F401

from infra.errors import ShardingError

try:
    # FSDP2's public home since torch 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # an older torch still runs DDP; `shard` says why --fsdp cannot
    FSDPModule = MixedPrecisionPolicy = fully_shard = None


def sync() -> None:
    """Wait for the queued CUDA work, where CUDA is in use (a no-op on CPU): once per phase."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def clock() -> float:
    """time.perf_counter() at a phase boundary, after `sync`."""
    sync()
    return time.perf_counter()


class Dist:
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them this is a single process."""

    def __init__(self, device: str, fsdp: bool = False, timeout_min: float = 60.0):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.master = self.rank == 0
        self.device = device
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if self.world > 1:
            if device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
                torch.cuda.set_device(self.device)
            # how long a collective waits for the slowest rank (--dist-timeout-min)
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_min))
        # FSDP2 needs a process group, even of one rank; an in-memory store needs no address
        elif fsdp:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduced sum (a float64 copy, on the collective's device)."""
        x = x.detach().to(self.device, torch.float64).clone()
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def sum_named(self, sums: dict[str, float]) -> dict[str, float]:
        """Named local sums, summed over ranks in one all-reduce (every rank has the same keys)."""
        keys = sorted(sums)
        return dict(zip(keys, self.sum(torch.tensor([float(sums[k]) for k in keys])).tolist()))

    def max(self, n: int) -> int:
        """All-reduced maximum of an integer."""
        x = torch.tensor([n], device=self.device)
        if self.world > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return int(x.item())

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's equal-sized x, in rank order (bool travels as uint8: not
        every backend has bool)."""
        if self.world == 1:
            return [x]
        y = x.to(self.device, torch.uint8 if x.dtype == torch.bool else x.dtype)
        out = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(out, y)
        return [o.to("cpu", x.dtype) for o in out]

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Free the process group with its gloo threads: none may run on into interpreter exit."""
        if dist.is_initialized():
            _drop_dtensor_caches()
            # the sharded model's reference cycles hold DTensors
            gc.collect()
            dist.destroy_process_group()


def _drop_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches (sharding propagation, redistribution plans, mesh
    topology). They keep every DeviceMesh FSDP2 used, a mesh keeps its process group
    (`_pg_registry`), and a group still referenced survives destroy_process_group: its gloo threads
    then ran on into interpreter exit, where a rank aborted at teardown ("terminate called without
    an active exception") in 2 of 16 finished 2-rank --fsdp runs here.
    These are private names of torch 2.13; one that a torch release lacks is skipped."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug
    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None),
                          "cache_clear", None),
                  getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None),
                                  "build_from_mesh", None), "cache_clear", None)):
        if clear is not None:
            clear()


# ---------------------------------------------------------------------------------------------
# Wrapping: DDP or FSDP2
# ---------------------------------------------------------------------------------------------

def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, found by the class names transformers lists as never to be split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ShardingError(f"--fsdp: no decoder layers found in {type(model).__name__} (its "
                            f"_no_split_modules: {sorted(names)})")
    return layers


def mixed_precision(device: str) -> MixedPrecisionPolicy:
    """bf16 weights for the forward and backward, float32 gradient reduce-scatter,
    on CUDA; float32 on CPU."""
    if device.startswith("cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """FSDP2 in place: one communication group per decoder layer,
    then the root (embeddings, norm, head).

    The root keeps its weights gathered after forward (backward needs them first); layers free
    theirs. Parameters move to `device` one group at a time,
    so the whole model never sits on one GPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    if fully_shard is None:
        raise ShardingError(f"--fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this "
                            f"is torch {torch.__version__}")
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    policy = mixed_precision(device)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def wrap(model: torch.nn.Module, ranks: Dist, fsdp: bool) -> torch.nn.Module:
    """The module to run forward/backward through: FSDP2 (model sharded in place),
    DDP, or the model itself."""
    if fsdp:
        return shard(model, ranks.device)
    if ranks.world > 1:
        # the gradients are views into DDP's all-reduce buckets, not a second copy of them (4 B a
        # trained parameter less at the update's peak; the buckets stay allocated between updates:
        # vllm_rollout.trainer_resident_bytes counts them); no buffer broadcast in each forward
        # (the buffers, RoPE's inv_freq, are the same on every rank and never trained)
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True,
                                                         **{DDP_BUFFER_SYNC: False})
    return model


# DDP's flag for syncing buffers in each forward: torch 2.13 renamed broadcast_buffers
DDP_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")


def is_sharded(model) -> bool:
    return FSDPModule is not None and isinstance(model, FSDPModule)


def grad_sync(policy: torch.nn.Module, last: bool):
    """Context for one micro-batch's backward: DDP all-reduces only on the last micro-batch of an
    update. FSDP2 reduce-scatters on every one (see the module docstring: its no-sync
    keeps full-size gradients)."""
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel) and not last:
        return policy.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def unsharded(model):
    """Run many forwards (a rollout, an evaluation) on FSDP2's gathered weights: one all-gather of
    the whole model on entry, none inside, reshard on exit.
    A no-op for a model that is not sharded (or None)."""
    if not is_sharded(model):
        yield
        return
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # recursive: no group frees its weights after a forward
    model.set_reshard_after_forward(False)
    for m in groups:                                    # unshard() is per group, not recursive
        m.unshard()
    try:
        yield
    finally:
        for m in groups:
            m.reshard()
            # back to shard(): layers free, root keeps
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_state_dict(model) -> dict:
    """The whole model's weights as plain CPU tensors on rank 0 (an empty dict on the other ranks
    when sharded); every rank must call it. A model that is not sharded
    returns its own state_dict."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t   # a DTensor: this rank's shard only
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer,
                ref: torch.nn.Module | None = None) -> int:
    """Bytes this rank holds of the policy's parameters and gradients, the optimizer's state, and
    the reference model's parameters (its shards under FSDP2, everything under DDP)."""
    n = sum(_local_bytes(p) + _local_bytes(p.grad) for p in model.parameters())
    n += sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor))
    if ref is not None:
        n += sum(_local_bytes(p) for p in ref.parameters())
    return n


@contextlib.contextmanager
def recompute(policy: torch.nn.Module, on: bool):
    """--gradient-checkpointing's layers recompute in backward only in training mode (transformers
    checks the layer's own `training`), and the model stays in eval mode: set it on those layers
    alone, for the gradient passes (dropout, in their children, stays off; no-grad passes, which
    some transformers versions would run without the KV cache in training mode, are left alone)."""
    if not on:  # the default: nothing to walk on every micro-batch
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in policy.modules() if isinstance(m, GradientCheckpointingLayer)
              and m.gradient_checkpointing and not m.training]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m in layers:
            m.training = False


def checkpoint_activations(model) -> None:
    """Keep only each decoder layer's input in the forward and recompute the layer in backward
    (non-reentrant torch.utils.checkpoint, through transformers: `activation_checkpointing_enable`
    since transformers 5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
