"""The fixtures every test shares (tests/helpers.py defines them; test_grpo.py imports them too)."""
from helpers import tiny_model, tiny_run_inputs  # noqa: F401
