"""Who may call whom: addresses and the plaintext rule (addresses), per-node credentials signed
by the launcher's issuer key (nodecred), and cluster certificates with the per-call check every
gRPC server runs (auth).  Below the fabric: it imports the wire and common/util only."""
