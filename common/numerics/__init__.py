"""Numerical building blocks of the algorithms, free of fedhop types: proximal operators (prox),
projections onto constraint sets (projections) and local-step sampling (sampling)."""
