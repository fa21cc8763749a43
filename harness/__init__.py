"""The run around the article: what train.py and evaluate.py need beyond the article's modules.

Not an article section. May import anything below it (the article's modules, infra/); nothing
below imports it (tests/test_layout.py checks):

- the command line and the run: flags (every flag, with its help), setup (data, policy, reference,
  engine, optimizer, resume), bookkeeping (the step's metrics row, held-out evaluation,
  checkpoints, the final model)
- the task and its data: data (rows, prompts, rewards), builtin (the built-in task and base model),
  math_verify_reward (--reward math-verify, in a worker process)
- evaluation: the estimators and evaluate_model, which train.py's held-out evaluation and
  evaluate.py both run
- Step 1 as the commands run it: rollout (autocast, slots, the context check), vllm_rollout
  (--rollout vllm)
- disk: checkpoint (atomic saves, resume, the run lock), models (loading and saving a model),
  lora (--lora-r)
- what is measured: metrics (the metric rows and run files), perf (model FLOPs and MFU), curves
"""
