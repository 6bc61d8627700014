"""Differential privacy for federated rounds (`[privacy]`, docs/privacy.md): the numerics, apart
from the roles.

- clip.py: the L2 norm of an update over all its tensors together, and clipping to a bound C;
- noise.py: Gaussian noise from the run's seeded stream, or from the operating system's
  cryptographically secure source (`privacy.secure_noise`);
- adaptive.py: the quantile-based clipping norm of Andrew et al. (NeurIPS 2021) and its split of
  the noise multiplier between the update and the clipped count;
- accountant.py: epsilon at `privacy.delta` from dp-accounting's RDP or PLD accountant, and the
  noise multiplier calibrated to a target epsilon;
- mechanism.py: the mechanism a run applies: the server's clipped, noised aggregate
  (`PrivateAggregate`), a client's clipped (and, for local DP, noised) update, and the
  per-round records (`ServerPrivacy`);
- edges.py: the mechanism behind edges (hierarchical): the edges clip in central mode, and the
  round's noise is added by the server or in shares by the edges (`privacy.noise_at`).
"""
