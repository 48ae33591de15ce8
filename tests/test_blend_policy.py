"""The deterministic draw policy as a pure function: bounded deviation from the target."""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.mixture.policy import deterministic_choice


def _run(weights_per_draw: np.ndarray):
    n_src = weights_per_draw.shape[1]
    targets, emitted = [0.0] * n_src, [0] * n_src
    dev = []  # D_s = target - emitted after each draw
    picks = []
    for w in weights_per_draw:
        i = deterministic_choice(targets, emitted, w)
        assert w[i] > 0
        for s in range(n_src):
            targets[s] += float(w[s])
        emitted[i] += 1
        picks.append(i)
        dev.append([t - e for t, e in zip(targets, emitted)])
    return np.array(picks), np.array(dev)


@pytest.mark.parametrize("seed", range(5))
def test_deviation_stays_within_one_sample_across_phase_switches(seed):
    rng = np.random.default_rng(seed)
    phases = [rng.dirichlet(np.ones(4)) for _ in range(6)]
    phases[2][1] = 0.0  # a source switched off for a phase
    phases[2] /= phases[2].sum()
    w = np.concatenate([np.tile(p, (int(rng.integers(50, 800)), 1)) for p in phases])
    ramp = np.linspace(phases[0], phases[-1], 300)  # and a continuous ramp
    w = np.concatenate([w, ramp])
    _, dev = _run(w)
    assert np.abs(dev).max() < 1.0  # any prefix: within one sample of the cumulative target
    # any window [a, b): realised - target = D(a) - D(b), so within 2 samples
    padded = np.vstack([np.zeros((1, 4)), dev])
    windows = padded[:, None, :] - padded[None, :, :]
    assert np.abs(windows).max() < 2.0


def test_zero_weight_is_never_drawn_and_ties_go_first():
    picks, _ = _run(np.tile([0.5, 0.0, 0.5], (10, 1)))
    assert 1 not in picks
    assert picks[0] == 0


def test_cumulative_target_not_current_weight_times_count():
    # After a switch from (0.9, 0.1) to (0.1, 0.9), a rule using `current weight * draws` would
    # draw only source 1 for a long stretch; the running sum catches up within one sample.
    w = np.concatenate([np.tile([0.9, 0.1], (1000, 1)), np.tile([0.1, 0.9], (100, 1))])
    picks, _ = _run(w)
    after = picks[1000:]
    assert abs((after == 1).sum() - 90) <= 1


def test_all_zero_is_an_error():
    with pytest.raises(ValueError, match="all weights are 0"):
        deterministic_choice([0.0], [0], np.array([0.0]))
