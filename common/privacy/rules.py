"""The `[privacy]` section's config rules (the config loader raises each as one line, exit 2):
what the keys may not combine, and what the rest of the config must be for the mechanism to
hold (docs/privacy.md).  Whether the algorithm replies with a model delta is the algorithm's
rule (common/algorithms/__init__.py `exchanges_delta`)."""
from __future__ import annotations

from typing import Any


def config_problem(cfg: Any) -> str | None:
    """Why `cfg.privacy` cannot run with the rest of `cfg` (one line naming the key), or None."""
    p = cfg.privacy
    if p.mode == "none":
        for key in ("noise_multiplier", "clip_norm", "target_epsilon"):
            if getattr(p, key):
                return (f"config key 'privacy.{key}': got {getattr(p, key)}, but privacy.mode is 'none' (set "
                        f"privacy.mode = 'central', 'client' or 'local')")
        if p.clipping != "fixed" or p.secure_noise or p.noise_at != "server":
            key = "clipping" if p.clipping != "fixed" else "secure_noise" if p.secure_noise else "noise_at"
            return f"config key 'privacy.{key}': needs privacy.mode (it is 'none')"
        return None
    if p.clip_norm <= 0:
        return (f"config key 'privacy.clip_norm': got {p.clip_norm}, privacy.mode = '{p.mode}' needs a clipping "
                f"bound C > 0 (the noise is scaled to it)")
    calibrate = p.target_epsilon > 0 and p.on_target == "calibrate"
    if calibrate and p.noise_multiplier:
        return (f"config key 'privacy.noise_multiplier': got {p.noise_multiplier}, but privacy.on_target = "
                f"'calibrate' sets it from privacy.target_epsilon; leave it 0")
    if p.target_epsilon > 0 and not calibrate and p.noise_multiplier == 0:
        return (f"config key 'privacy.target_epsilon': got {p.target_epsilon}, but privacy.noise_multiplier is 0 "
                f"(no noise: epsilon is infinite from the first round); set a noise multiplier or "
                f"privacy.on_target = 'calibrate'")
    if p.mode == "dpsgd" and (p.clipping != "fixed" or calibrate):
        key = "clipping" if p.clipping != "fixed" else "on_target"
        return (f"config key 'privacy.{key}': not implemented for privacy.mode = 'dpsgd' (sample-level DP-SGD "
                f"clips each example's gradient to a fixed clip_norm with a configured noise_multiplier)")
    if p.sampling == "fixed_size" and p.accountant != "rdp":
        return ("config key 'privacy.sampling': 'fixed_size' (sampling without replacement) is accounted by the "
                "RDP accountant only; use privacy.accountant = 'rdp' or sampling = 'poisson'")
    if p.clipping == "adaptive":
        if p.mode == "local":
            return ("config key 'privacy.clipping': 'adaptive' needs the server's noisy count of unclipped updates; "
                    "local DP has no trusted aggregator to add it (use privacy.mode = 'central' or 'client')")
        sigma_b = p.clipped_count_stddev or _expected(cfg) / 20.0
        if not calibrate and p.noise_multiplier and 2 * sigma_b <= p.noise_multiplier:
            return (f"config key 'privacy.clipped_count_stddev': sigma_b = {sigma_b:g} leaves no noise for the update: "
                    f"z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 needs 2 sigma_b > privacy.noise_multiplier = "
                    f"{p.noise_multiplier}")
    grouping = _grouping(cfg.topology.kind)
    if grouping not in ("round", "edge"):
        from fedhop.common.topologies import builtin_specs
        kinds = ", ".join(f"'{k}'" for k, spec in builtin_specs().items() if spec.robust in ("round", "edge"))
        return (f"config key 'privacy.mode': '{p.mode}' needs a topology whose server (or whose edges) receive "
                f"each sampled client's update apart, one group per round (topology.kind = {kinds}), got "
                f"'{cfg.topology.kind}'")
    if grouping == "edge":
        from fedhop.common.privacy.edges import config_problem as edge_problem
        problem = edge_problem(cfg)
        if problem is not None:
            return problem
    elif p.noise_at != "server":
        return (f"config key 'privacy.noise_at': got '{p.noise_at}', but topology.kind = '{cfg.topology.kind}' "
                f"has no edges; use 'server'")
    if cfg.algorithm.weighting != "uniform" and p.mode != "dpsgd":
        return (f"config key 'algorithm.weighting': got '{cfg.algorithm.weighting}', but privacy.mode = "
                f"'{p.mode}' needs 'uniform' (each client's clipped update counts once: the sensitivity of the "
                f"sum is C)")
    if cfg.security.aggregation != "mean":
        return (f"config key 'security.aggregation': got '{cfg.security.aggregation}', but privacy.mode = "
                f"'{p.mode}' noises the sum of the clipped updates; use 'mean'")
    from fedhop.common.transport.factory import sums_in_collective
    if sums_in_collective(cfg.transport.kind):
        return (f"config key 'transport.kind': got '{cfg.transport.kind}', which sums the updates in a "
                f"collective, but privacy.mode = '{p.mode}' clips each update at the server; use 'grpc'")
    sa = getattr(cfg, "secure_aggregation", None)
    if sa is not None and sa.enabled and p.mode in ("central", "client") and p.clip_norm > sa.clip:
        return (f"config key 'privacy.clip_norm': got {p.clip_norm}, above secure_aggregation.clip = {sa.clip}: "
                f"the quantization range [-clip, clip] must hold an update clipped to C (set "
                f"secure_aggregation.clip >= privacy.clip_norm)")
    if sa is not None and sa.enabled and p.mode in ("central", "client") and cfg.compression.up == "sign":
        return (f"config key 'compression.up': 'sign' with privacy.mode = '{p.mode}': a sign code's update (+-1 per "
                f"coordinate) has norm sqrt(d) whatever privacy.clip_norm, so noise scaled to C bounds nothing; "
                f"use 'rounding', 'qsgd' or 'none'")
    if p.mode == "client" and cfg.compression.up != "none":
        return (f"config key 'compression.up': got '{cfg.compression.up}', but privacy.mode = 'client' bounds "
                f"each update before it is coded; use privacy.mode = 'central' (the server clips the decoded "
                f"update) or compression.up = 'none'")
    return None


def _grouping(kind: str) -> str | None:
    """Where topology `kind` gets the round's client updates one by one, as one group (its spec's
    `robust` grouping): "round" at the server (star), "edge" at each edge (hierarchical: the edges
    clip, common/privacy/edges.py), None for neither (the mechanism has no place to clip)."""
    from fedhop.common.topologies import spec_for
    try:
        return spec_for(kind).robust
    except (KeyError, ValueError):   # an unknown kind: the options check names it
        return "round"


def _expected(cfg: Any) -> int:
    from fedhop.common.config.schema import resolve_clients_per_round
    return resolve_clients_per_round(cfg)
