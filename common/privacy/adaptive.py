"""Quantile-based adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021).

Each sampled client reports b_i = 1[||Delta_i|| <= C] beside its clipped update; the server adds
N(0, sigma_b^2) to the sum and divides by the expected number of clients m:

    b_bar = (sum_i b_i + N(0, sigma_b^2)) / m                     (Algorithm 1, the noisy count)
    C    <- C * exp(-eta_C * (b_bar - gamma))                     (Section 3, the geometric update)

so C moves towards the gamma-quantile of the update norms.  The count is a second Gaussian
query released every round; the paper splits the privacy budget so the pair costs what one
Gaussian mechanism of noise multiplier z costs: the update's sum gets the multiplier

    z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)                      (Section 3.1)

(the count has sensitivity 1/2 once b_i - 1/2 is summed, hence the 2 sigma_b), which needs
2 sigma_b > z.  The accountant is then charged z itself.
"""
from __future__ import annotations

import math


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2); z = 0 stays 0.  Raises ValueError where
    2 sigma_b <= z (the count would take the whole budget)."""
    if z == 0:
        return 0.0
    if 2 * sigma_b <= z:
        raise ValueError(f"adaptive clipping needs 2 * clipped_count_stddev > noise_multiplier: "
                         f"2 * {sigma_b} <= {z}")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def next_clip_norm(clip: float, noisy_count: float, expected: float, eta: float, gamma: float) -> float:
    """C * exp(-eta_C * (b_bar - gamma)) with b_bar = noisy_count / expected."""
    b_bar = noisy_count / expected
    return clip * math.exp(-eta * (b_bar - gamma))
