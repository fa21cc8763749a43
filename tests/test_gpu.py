"""The GPU tests (marked gpu): skipped, with the reason, where CUDA is missing; on a GPU machine:

    python -m pytest -q test_grpo.py tests -m gpu
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from launch import ROOT, run_train, torchrun
from sampler import sample_groups
from test_grpo import PROMPTS, tiny, tiny_flags, weights_of

# ---------------------------------------------------------------------------------------------
# On GPUs (python -m pytest -q test_grpo.py tests -m gpu): skipped, with the reason, where CUDA is
# missing
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (on a GPU machine: pytest -m gpu)")


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs (on a GPU machine: pytest -m gpu)")


def _train_rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)]


@pytest.mark.slow
@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_steps_train_float32_weights(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    run_train(d, tmp_path / "run", "--device", "cuda", "--steps", "3", "--algo", "grpo",
               "--reward", "tinyreward:has_x")
    # the default on CUDA
    assert json.loads((tmp_path / "run" / "config.json").read_text())["bf16"] is True
    rows = _train_rows(tmp_path / "run")
    assert len(rows) == 3 and all(math.isfinite(v) for r in rows for v in r.values())
    w, start = weights_of(tmp_path / "run" / "final"), weights_of(d / "model")
    assert ({v.dtype for v in w.values()} == {torch.float32}
            and any(not torch.equal(start[k], w[k]) for k in w))


@pytest.mark.gpu
@needs_cuda
def test_gpu_sampler_greedy_equals_generate():
    model = tiny("qwen2", torch.float32).cuda()
    roll = sample_groups(model, PROMPTS, 2, 16, eos_token_id=1, pad_token_id=0, temperature=0.0)
    assert roll.response_ids.is_cuda
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                             eos_token_id=1, pad_token_id=0)[0, len(p):].tolist()
        for r in (2 * i, 2 * i + 1):
            L = int(roll.lengths[r])
            assert roll.response_ids[r, :L].tolist() == ref[:L]


@pytest.mark.slow
@pytest.mark.gpu
@needs_cuda
def test_gpu_fsdp_on_one_gpu_trains_saves_and_resumes(tiny_run_inputs, tmp_path):
    d, out = tiny_run_inputs, tmp_path / "run"
    flags = [*tiny_flags(d, out), "--device", "cuda", "--fsdp", "--beta", "0.04", "--save-every",
             "2"]
    torchrun(1, os.path.join(ROOT, "train.py"), *flags, "--steps", "2")
    torchrun(1, os.path.join(ROOT, "train.py"), *flags, "--steps", "3", "--resume")
    rows = _train_rows(out)
    assert ([r["step"] for r in rows] == [1, 2, 3]
            and all(math.isfinite(v) for r in rows for v in r.values()))
    w, start = weights_of(out / "final"), weights_of(d / "model")
    assert ({v.dtype for v in w.values()} == {torch.float32}
            and any(not torch.equal(start[k], w[k]) for k in w))


@pytest.mark.slow
@pytest.mark.gpu
@needs_two_gpus
def test_gpu_two_ranks_nccl_ddp_and_fsdp(tiny_run_inputs, tmp_path):
    d, state = tiny_run_inputs, {}
    for mode, extra in (("ddp", []), ("fsdp", ["--fsdp", "--save-every", "2"])):
        out = tmp_path / mode
        torchrun(2, os.path.join(ROOT, "train.py"), *tiny_flags(d, out), "--device", "cuda",
                  "--steps", "2", "--beta", "0.04", *extra)
        rows = _train_rows(out)
        assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values())
        state[mode] = rows[-1]["memory/state_bytes"]
    print(f"per-rank state bytes on 2 GPUs: DDP {state['ddp']}, FSDP {state['fsdp']}")
    assert state["fsdp"] <= 0.55 * state["ddp"]
