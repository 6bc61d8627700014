"""The audience check of every incoming call on a process hosting many logical clients (issue 49):
`authenticate` tests the token's audience against `NodeCredentials.names()`, the process's node id
and its hosted clients.  A client process of `fedhop bench scale --clients 100000 --processes 4`
hosts 25,000 of them; the check must cost the same whatever that number, and still refuse a
token addressed to a client the process does not host.

The cost is counted in operations, not seconds (a timing would flake on a loaded machine): how
often the hosted ids are walked (`CountingIds` counts every iteration over them) and how many
bytes one check allocates (tracemalloc's peak), at 1 and at 25,000 hosted clients.
"""
from __future__ import annotations

import tracemalloc
from collections.abc import Iterator, MutableSet

import pytest

from fedhop.common.security.auth import AuthRefused, NodeCredentials, TokenAuthority, authenticate
from fedhop.common.util.nodeids import client_node

ISSUER = TokenAuthority()


class CountingIds(MutableSet):
    """A set of hosted client ids that counts how often it is walked end to end."""

    def __init__(self, ids) -> None:
        self._ids = set(ids)
        self.walks = 0

    def __contains__(self, x: object) -> bool:
        return x in self._ids

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, value: str) -> None:
        self._ids.add(value)

    def discard(self, value: str) -> None:
        self._ids.discard(value)


def _process(hosted: int) -> tuple[NodeCredentials, CountingIds]:
    """A client process's credentials, as client/__main__.py makes them: its hosted clients' node
    ids are its aliases."""
    creds = NodeCredentials.from_options("client-proc0", env_cred=ISSUER.issue("client-proc0"))
    ids = CountingIds(client_node(c) for c in range(hosted))
    creds.aliases = ids   # type: ignore[assignment]   # any set of names; this one counts its walks
    return creds, ids


def _call(creds: NodeCredentials, audience: str) -> str:
    """The server's `train` call to `audience` at this process, authenticated as it arrives."""
    server = NodeCredentials.from_options("server", env_cred=ISSUER.issue("server"))
    return authenticate(creds, dict(server.metadata(audience)), context=None, method="Call")   # type: ignore[arg-type]


def _peak_bytes(creds: NodeCredentials, audience: str) -> int:
    server = NodeCredentials.from_options("server", env_cred=ISSUER.issue("server"))
    meta = dict(server.metadata(audience))
    authenticate(creds, meta, context=None, method="Call")   # type: ignore[arg-type]   # the token is verified (cached) once
    tracemalloc.start()
    try:
        authenticate(creds, meta, context=None, method="Call")   # type: ignore[arg-type]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_call_to_a_hosted_client_never_walks_the_hosted_ids():
    creds, ids = _process(25_000)
    for c in (0, 12_345, 24_999):
        assert _call(creds, client_node(c)) == "server"
    assert _call(creds, "client-proc0") == "server"          # the process itself
    assert ids.walks == 0, f"the {len(ids)} hosted ids were walked {ids.walks} times for 4 calls"


@pytest.mark.parametrize("audience", [client_node(25_000), client_node(-1), "client-proc1", "server", ""])
def test_a_call_to_a_client_the_process_does_not_host_is_still_refused(audience):
    creds, ids = _process(25_000)
    with pytest.raises(AuthRefused, match="not for this node"):
        _call(creds, audience)
    assert ids.walks == 0


def test_the_memory_one_check_allocates_does_not_grow_with_the_hosted_clients():
    """A set of 25,000 names is about 1 MiB; one check at 25,000 hosted clients allocates no more
    than at 1 (plus a small margin for the allocator's bookkeeping)."""
    few, _ = _process(1)
    many, _ = _process(25_000)
    small, large = _peak_bytes(few, client_node(0)), _peak_bytes(many, client_node(0))
    assert large <= small + 4096, (small, large)


def test_the_names_view_is_live_and_reads_as_the_set_of_names():
    """Aliases added after the credentials were made (as client/__main__.py adds them) count at
    once, and the view compares, iterates and counts as the set {node id, *aliases}."""
    creds = NodeCredentials.from_options("client-proc0", env_cred=ISSUER.issue("client-proc0"))
    names = creds.names()
    assert "client-7" not in names
    creds.aliases.update(client_node(c) for c in (7, 8))
    assert "client-7" in names and names == {"client-proc0", "client-7", "client-8"}
    assert sorted(names) == ["client-7", "client-8", "client-proc0"] and len(names) == 3
    creds.aliases.add("client-proc0")   # the node id listed again is still one name
    assert len(names) == 3 and sorted(names) == ["client-7", "client-8", "client-proc0"]
