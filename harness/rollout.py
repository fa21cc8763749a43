"""Step 1 as the commands run it: sampler.sample_groups under --bf16 autocast with --max-num-seqs
slots, or a vLLM engine's sample_groups.

Article section: "Step 1: Rollout 采样" (sampler.py is the step; this picks how it runs).
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import sampler
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


@contextlib.contextmanager
def sampling(model, prompts: list[list[int]], args, engine: bool = False):
    """What Step 1 runs in (train.rollout, evaluation): the prompts checked against the model's
    context; for sampler.sample_groups --bf16 autocast with the frozen weights cast once
    (`frozen_in`), and it yields the slots, at most --max-num-seqs rows at once (None: every row);
    for a vLLM engine (engine=True), which holds its own weights and concurrency and runs without
    autocast, nothing more (it yields None). `args` carries flags.EvalArgs' fields
    (max_new_tokens, max_num_seqs, bf16)."""
    check_context(model, prompts, args.max_new_tokens)
    if engine:
        yield None
        return
    with (torch.autocast(next(model.parameters()).device.type, torch.bfloat16, enabled=args.bf16),
          frozen_in(model, torch.bfloat16 if args.bf16 else None)):
        yield args.max_num_seqs


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


def sample_rollout(model, prompts: list[list[int]], G: int, temperature: float, top_p: float,
                   generator, eos: list[int], pad: int, args, sample=None) -> Rollout:
    """Step 1 as evaluation runs it: sampler.sample_groups in `sampling`, or `sample`, a vLLM
    engine's sample_groups."""
    with sampling(model, prompts, args, engine=sample is not None) as S:
        if sample is not None:
            return sample(model, prompts, G, args.max_new_tokens, eos, pad, temperature, top_p,
                          generator=generator)
        return sampler.sample_groups(model, prompts, G, args.max_new_tokens, eos, pad,
                                     temperature, top_p, generator=generator, max_num_seqs=S)


@dataclass
class StepDraw:
    """Steps 1 + 2 of one training step (train.draw_step): the rollout trained on, the sampling/*
    metrics, every (rollout, timings) of the rounds used, kept or not, and the rollouts of rounds
    drawn ahead and not used (their FLOPs count)."""
    roll: Rollout
    stats: dict[str, float]
    rounds: list[tuple[Rollout, dict]]
    unused: list[Rollout] = field(default_factory=list)


class RoundsAhead:
    """draw(round) for dapo.dynamic_sampling: round r of a step is the prompts from `first` + r
    rounds on; the first call draws `ahead` rounds together (one decode loop over their rows costs
    less than one per round: the built-in model's 1,024 rows 1.3 s, four loops of 256 rows 2.0 s),
    every later round alone, never past `max_rounds`. A round's rollout does not depend on what is
    drawn with it (each prompt has its own generator), and the rounds are used in order, so the
    step trains on what drawing round by round gives. draw_rounds(first, k) -> k (rollout,
    timings)."""

    def __init__(self, draw_rounds: Callable[[int, int], list[tuple]], first: int,
                 per_round: int, max_rounds: int, ahead: int = 1):
        self.draw_rounds, self.first, self.per_round = draw_rounds, first, per_round
        self.max_rounds, self.ahead = max_rounds, ahead
        self.drawn: dict[int, tuple] = {}                    # round -> (rollout, timings)

    def __call__(self, rnd: int) -> tuple:
        if rnd not in self.drawn:
            k = min(self.ahead if rnd == 0 else 1, self.max_rounds - rnd)
            start = self.first + rnd * self.per_round
            self.drawn.update(enumerate(self.draw_rounds(start, k), rnd))
        return self.drawn[rnd]

    def unused(self, used: list[tuple]) -> list[Rollout]:
        """The rollouts of the rounds drawn past the `used` ones, dropped (the next step's stream
        starts at them); their time goes on the last round used."""
        extra = [self.drawn[r] for r in sorted(self.drawn) if r >= len(used)]
        for key in used[-1][1]:
            used[-1][1][key] += sum(t[key] for _, t in extra)
        return [r for r, _ in extra]
