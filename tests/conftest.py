"""Fixtures the tests in tests/ share with test_grpo.py (which defines them)."""
from test_grpo import tiny_model, tiny_run_inputs  # noqa: F401
