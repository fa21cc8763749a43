"""The mechanism figure's numbers (ablate/mechanisms.py), checked by hand, and its page kept fresh.

Article sections: "Step 4: PPO Loss 计算" and "DAPO：四项修正" (Clip-Higher, Overlong Reward
Shaping, Token-Level Loss, Dynamic Sampling), as drawn by `python -m ablate.mechanisms`. The numeric
tests need no matplotlib; the drawing test skips without it.

    python -m pytest -q tests/test_mechanisms.py
"""
from __future__ import annotations

import os

import pytest

from ablate import mechanisms
from launch import ROOT

RESULTS = os.path.join(ROOT, "results")


def test_clip_curve_by_hand():
    # train.py's clip ranges: GRPO symmetric 0.2, DAPO's Clip-Higher 0.2 / 0.28
    assert mechanisms.clip_ranges() == {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28)}
    # rho 1.25, A = +1: -min(1.25, clip(1.25)) = -min(1.25, 1.2) = -1.2, clipped: no gradient;
    # eps_high 0.28 leaves 1.25 unclipped: -1.25, gradient d(-rho A)/d log pi = -rho A = -1.25
    sym = mechanisms.clip_curve([1.25], 1.0, 0.2, 0.2)
    dap = mechanisms.clip_curve([1.25], 1.0, 0.2, 0.28)
    assert sym["loss"] == pytest.approx([-1.2]) and sym["grad"] == [0.0]
    assert dap["loss"] == pytest.approx([-1.25]) and dap["grad"] == pytest.approx([-1.25])
    # A = -1: -min(-rho, -clip(rho)) = max(rho, clip(rho)); at 0.7 that is 0.8 (clipped below, no
    # gradient), at 1.25 it is 1.25 (never clipped above for A < 0), gradient +rho = 1.25
    neg = mechanisms.clip_curve([0.7, 1.0, 1.25], -1.0, 0.2, 0.28)
    assert neg["loss"] == pytest.approx([0.8, 1.0, 1.25])
    assert neg["grad"] == pytest.approx([0.0, 1.0, 1.25])


def test_overlong_ramp_by_hand():
    # train.py's built-in defaults: --max-new-tokens 40, --overlong-cache 40 // 5 = 8
    L, C = mechanisms.overlong_defaults()
    assert (L, C) == (40, 8)
    # Eq. 13: 0 up to L_max - cache = 32, then (32 - L) / 8: 33 -> -1/8, 36 = L_max - cache / 2
    # -> -0.5
    assert mechanisms.overlong_ramp([0, 32, 33, 36, 40], L, C) == pytest.approx(
        [0.0, 0.0, -0.125, -0.5, -1.0])
    # the paper's 20480 / 4096: 16384 + 2048 = 18432 is half way down the ramp
    assert mechanisms.overlong_ramp([16384, 18432, 20480], *mechanisms.PAPER_OVERLONG) == \
        pytest.approx([0.0, -0.5, -1.0])


def test_reduction_weights_by_hand():
    w = mechanisms.reduction_weights((5, 40))
    # sequence: 1 / (G |o_i|): the 40-token response's tokens get 1/(2*40), the 5-token's 1/(2*5)
    assert w["sequence"][1] == pytest.approx([1 / (2 * 40)] * 40)
    assert w["sequence"][0] == pytest.approx([1 / (2 * 5)] * 5)
    # token (DAPO Eq. 12): every token 1/45, so the long response carries 40/45 of the loss
    assert w["token"][0] + w["token"][1] == pytest.approx([1 / 45] * 45)
    # constant (Dr. GRPO): 1 / (G * T) = 1/80 each, T = 40 the longest
    assert w["constant"][0] + w["constant"][1] == pytest.approx([1 / 80] * 45)


def test_zero_share_by_hand_and_through_constant_groups():
    # p = 0.5, G = 4: 0.5^4 + 0.5^4 = 1/8; p = 0.75: 81/256 + 1/256
    assert mechanisms.zero_share(0.5, 4) == 0.125
    assert mechanisms.zero_share(0.75, 4) == pytest.approx(82 / 256)
    # the trainer's grpo.constant_groups on sampled Bernoulli groups lands within 3 SE
    for p, G in ((0.5, 4), (0.75, 4), (0.9, 8), (0.3, 16)):
        share, se = mechanisms.zero_share_sampled(p, G, groups=20000, seed=1)
        assert abs(share - mechanisms.zero_share(p, G)) < 3 * se, (p, G, share, se)


def test_measured_summary_by_hand():
    rows = [{"group_size": 4, "step": 1, "groups": 32, "reward/correct": 0.5,
             "reward/frac_zero_std": 0.25},
            {"group_size": 4, "step": 2, "groups": 32, "reward/correct": 0.75,
             "reward/frac_zero_std": 0.25}]
    s = mechanisms.measured_summary(rows)[4]
    # curve: 0.125 at 0.5 and 82/256 at 0.75; the second step lies below it
    assert s["curve"] == pytest.approx((0.125 + 82 / 256) / 2)
    assert (s["steps"], s["accuracy"], s["measured"], s["above"]) == (2, 0.625, 0.25, 1)


def _table(md: str) -> dict[tuple[str, str], str]:
    """(panel, quantity) -> value cell of the key-number table in a page."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
             if line.startswith("| ") and not line.startswith("| panel |")]
    return {(p, q): v for p, q, v in cells}


def test_results_page_says_what_the_functions_compute_now():
    measured = mechanisms.read_measured(os.path.join(RESULTS, mechanisms.MEASURED))
    assert {r["group_size"] for r in measured} >= {4}
    with open(os.path.join(RESULTS, "mechanisms.md"), encoding="utf-8") as fh:
        page = fh.read()
    written = _table(page)
    now = {(p, q): f"{v + 0.0:.4g}" for p, q, v in mechanisms.key_numbers(measured)}
    stale = {k: (written.get(k), v) for k, v in now.items() if written.get(k) != v}
    assert not stale, f"results/mechanisms.md is stale (written, now): {stale}"
    assert set(written) == set(now)
    assert float(written[("1 clip", "loss at rho 1.25, A = +1, eps 0.2/0.2 (clipped)")]) == -1.2
    # and the captions: the whole page is what `python -m ablate.mechanisms` writes
    assert page == mechanisms.markdown(measured, "results")


def test_figure_reads_alone_and_is_drawn_to_a_png(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [{"group_size": 4, "step": 1, "groups": 32, "reward/correct": 0.6,
             "reward/frac_zero_std": 0.3}]
    fig = mechanisms.figure(rows)
    panels, top = fig.axes[:4], fig.axes[4:]  # the four panels; panel 2's top axis (the paper's)
    for ax in panels:  # each panel: a title, both labels (with units), a legend
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend()
    assert [ax.get_xlabel() for ax in top] == ["paper's response length (tokens)"]
    labels = [t.get_text() for t in panels[3].get_legend().get_texts()]
    assert "G = 4: measured, one dot per step" in labels
    plt.close(fig)
    path = tmp_path / "mechanisms.png"
    assert mechanisms.plot(rows, str(path))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
