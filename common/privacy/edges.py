"""Differential privacy behind edges (topology.kind = "hierarchical", docs/privacy.md "Behind
edges"): where each part of the mechanism (common/privacy/mechanism.py) runs when an edge stands
between the clients and the server.

- Clipping happens where the star's mechanism puts it, one hop earlier: in central mode at the
  edge (the first aggregator that sees a client's raw update; the edge's `PrivateAggregate`
  clips each reply to the C of the round's broadcast, `begin_round`), in client and local modes
  at the client.  The edge's partial is the sum of its clients' clipped updates, sensitivity C
  for one client of the cluster.
- The noise N(0, (z C)^2) on the sum over all the round's sampled clients (central and client
  modes) is added once in total, by one of two placements (`privacy.noise_at`):
    server: the server adds it to the sum of the edges' partials, as on the star (the server and
          the edges are trusted: each sees un-noised sums);
    edges:  edge e adds its share N(0, (z C)^2 n_e / m) (n_e its sampled clients, m the round's
          expected clients, the fixed denominator) to its partial (`release`); independent
          Gaussians add, so the sum of the partials carries N(0, (z C)^2 sum_e n_e / m) =
          N(0, (z C)^2) when the sample is m clients.  The server never sees an un-noised sum;
          where shares are missing (an edge that failed, a sample short of m) the server adds the
          rest, N(0, (z C)^2 (1 - sum_e n_e / m)), so the released model always carries the full
          noise (`top_up_share`).
  Adaptive clipping's count crosses the edges the same way: each edge sums its clients' bits
  b_i, and the count's noise N(0, sigma_b^2) is added by the server, or shared by the edges as
  N(0, sigma_b^2 n_e / m) with the server's top-up.
- One round is one release (kappa2 = 1): with kappa2 > 1 the edge models between the
  iterations reach the clients un-noised and one client's update moves every later iteration's
  updates of its cluster, so the sum's sensitivity is no longer C; central and client modes
  refuse it.  Local DP and DP-SGD noise each client release, so kappa2 iterations are kappa2
  releases of a client a round (`releases_per_round`), and the accountant composes them.
"""
from __future__ import annotations

import math
from typing import Any

from fedhop.common.privacy.noise import GaussianSource, add_noise
from fedhop.common.wire.message import Payload

SHARE_KEY = "dp_noise_share"   # partial scalar: the fraction n_e / m of the round's noise variance an edge added


def releases_per_round(cfg: Any) -> int:
    """How many times a round releases each sampled client's update: the topology's edge
    iterations (hierarchical: kappa2), 1 on the star."""
    from fedhop.common.topologies import spec_for
    from fedhop.common.topologies.graphs import topology_params
    try:
        key = spec_for(cfg.topology.kind).edge_steps_key
    except (KeyError, ValueError):
        return 1
    if not key:
        return 1
    return int(getattr(topology_params(cfg), key, 1))


def config_problem(cfg: Any) -> str | None:
    """Why `cfg.privacy` cannot run behind `cfg.topology`'s edges (one line naming the key), or None."""
    p = cfg.privacy
    from fedhop.common.topologies.graphs import topology_params
    params = topology_params(cfg)
    if p.mode not in ("central", "client"):
        if p.noise_at != "server":
            return (f"config key 'privacy.noise_at': got '{p.noise_at}', but privacy.mode = '{p.mode}' adds no noise "
                    f"to a sum (each client noises its own release); leave it 'server'")
        return None
    kappa2 = releases_per_round(cfg)
    if kappa2 > 1:
        return (f"config key 'topology.kappa2': got {kappa2}, but privacy.mode = '{p.mode}' noises one aggregation "
                f"a round: with more edge iterations the edge models between them reach the clients un-noised and "
                f"one client's update moves its cluster's later updates (the sum's sensitivity is no longer C); "
                f"use kappa2 = 1, or privacy.mode = 'local' or 'dpsgd'")
    drawn = int(getattr(params, "edges_per_round", 0))
    if drawn > 0:
        return (f"config key 'topology.edges_per_round': got {drawn}, but privacy.mode = '{p.mode}' is accounted "
                f"as sampling each client with rate clients.per_round / clients.count; drawing edges first is "
                f"another sampling event; use 0 (every edge)")
    if p.noise_at == "server" and cfg.compression.up != "none":
        return (f"config key 'compression.up': got '{cfg.compression.up}', but with privacy.noise_at = 'server' "
                f"each edge's clipped sum is coded before the server noises it (a coder's error is not bounded "
                f"by C); use privacy.noise_at = 'edges' (the edges noise before they code) or compression.up = "
                f"'none'")
    return None


def edges_noise(s: Any) -> bool:
    """Whether the edges add the round's noise in shares (privacy.noise_at = "edges")."""
    return bool(s.server_noise and s.noise_at == "edges")


def _private(algorithm: Any) -> Any:
    """The algorithm's private aggregate (installed by `build_algorithm` under [privacy]), or None."""
    from fedhop.common.privacy.mechanism import PrivateAggregate
    aggregate = getattr(algorithm, "aggregate", None)
    return aggregate if isinstance(aggregate, PrivateAggregate) else None


def begin_round(algorithm: Any, message: Payload) -> None:
    """An edge's private aggregate clips with the round's C, as the server's broadcast states it
    (adaptive clipping moves it round by round); nothing without [privacy]."""
    from fedhop.common.privacy.mechanism import CLIP_KEY
    aggregate = _private(algorithm)
    if aggregate is not None and CLIP_KEY in message.scalars:
        aggregate.clip_norm = float(message.scalars[CLIP_KEY])


def release(algorithm: Any, partial: Payload, sampled: int, edge: int, round: int) -> Payload:
    """An edge's partial as it leaves the edge: with privacy.noise_at = "edges", its share of the
    round's noise, N(0, (z_Delta C)^2 n_e / m) on the update's sum and N(0, sigma_b^2 n_e / m) on
    the count of unclipped updates (adaptive clipping), from the stream ("privacy", "edge", e,
    "round", r), and the share n_e / m it added (`SHARE_KEY`); otherwise the partial as it is."""
    from fedhop.common.privacy.mechanism import UNCLIPPED_KEY, update_names
    aggregate = _private(algorithm)
    if aggregate is None or not edges_noise(aggregate.s):
        return partial
    s = aggregate.s
    share = sampled / s.expected
    source = GaussianSource(s.secure, aggregate.seed, "edge", edge, "round", round)
    tensors = add_noise(partial.tensors, s.z_update * aggregate.clip_norm * math.sqrt(share), source,
                        update_names(partial.tensors, aggregate.ops))
    scalars = {**partial.scalars, SHARE_KEY: share}
    if s.adaptive:
        scalars[UNCLIPPED_KEY] = float(scalars.get(UNCLIPPED_KEY, 0.0)) + source.scalar(s.sigma_b * math.sqrt(share))
    return Payload(tensors=tensors, scalars=scalars, control=partial.control)


def top_up_share(s: Any, summed: Payload) -> float:
    """The fraction of the round's noise variance the server adds: all of it with the noise at
    the server, else what the edges' shares (summed in the aggregate's `SHARE_KEY`) left, 1 -
    sum_e n_e / m, never below 0."""
    if not edges_noise(s):
        return 1.0
    return max(0.0, 1.0 - float(summed.scalars.get(SHARE_KEY, 0.0)))
