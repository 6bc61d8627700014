"""The typed failures of a secure-aggregation round.

`SecAggFailure` is the server's: the round cannot recover the sum (too few survivors to reconstruct
a secret, too few clients left to aggregate); it never returns a wrong sum instead.  `SecAggRefusal`
is a client's: it refuses a request that would break the protocol's privacy (both secrets of one
client asked for, a share blob that does not authenticate, ...)."""
from __future__ import annotations

# the reasons a round fails (SecAggFailure.reason)
TOO_FEW_CLIENTS = "too_few_clients"            # fewer live clients than the threshold in a phase
NEIGHBOURHOOD_BELOW_THRESHOLD = "neighbourhood_below_threshold"   # a secret's holders fell below t
TOO_FEW_SHARES = "too_few_shares"              # unmasking: fewer than t shares came back for a secret
BAD_MESSAGE = "bad_message"                    # a message that does not parse to its layout


class SecAggFailure(Exception):
    """The round cannot produce the exact sum; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SecAggRefusal(Exception):
    """A client refuses a request (the protocol's privacy guard, or a blob that fails to decrypt)."""
