"""Secure aggregation's protocol methods (docs/secure-aggregation.md), declared by the star spec:
each phase of SecAgg+ is its own method, obeyed from the parent (the server), so the ledger counts
its messages under its own name.  Kept apart from secagg_wire.py (which imports torch) because
the spec, and so the config loader, reads them."""
from __future__ import annotations

from fedhop.common.wire.methods import PARENT, Method

SECAGG_ADVERTISE = Method("secagg_advertise", {PARENT})
SECAGG_SHARE = Method("secagg_share", {PARENT})
SECAGG_MASKED = Method("secagg_masked", {PARENT})
SECAGG_UNMASK = Method("secagg_unmask", {PARENT})
METHODS = (SECAGG_ADVERTISE, SECAGG_SHARE, SECAGG_MASKED, SECAGG_UNMASK)
