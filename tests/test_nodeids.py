"""Node ids built and parsed in one module (common/util/nodeids.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from fedhop.client.host import parse_client_id
from fedhop.common.transport.base import HandlerError
from fedhop.common.util.nodeids import (
    SERVER,
    client_id,
    client_id_of,
    client_node,
    client_proc_node,
    edge_index,
    edge_node,
)
from fedhop.common.wire.methods import role_of

IDS = [0, 1, 9, 10, 99, 1000, *np.random.default_rng(11).integers(0, 10**9, size=20).tolist()]
NOT_A_NUMBER = ["", "-1", "1a", "01x", " 3", "3 ", "+3", "1.5", "\u0663"]   # the last: a non-ASCII digit (int() reads 3)


@pytest.mark.parametrize("n", IDS)
def test_round_trips(n):
    assert client_id(client_node(n)) == n and client_id_of(client_node(n)) == n
    assert edge_index(edge_node(n)) == n
    assert re.fullmatch(r"client-\d+", client_node(n)) and str(n) == client_node(n).rsplit("-", 1)[1]
    assert re.fullmatch(r"edge-\d+", edge_node(n)) and re.fullmatch(r"client-proc\d+", client_proc_node(n))
    # the roles read from every kind of id (common/wire/methods.py), as the ledger's links use them
    assert (role_of(client_node(n)), role_of(edge_node(n)), role_of(client_proc_node(n)), role_of(SERVER)) == \
           ("client", "edge", "client", "server")


@pytest.mark.parametrize("n", IDS[:6])
def test_other_kinds_of_id_name_no_client_and_no_edge(n):
    for other in (client_proc_node(n), edge_node(n), SERVER):
        assert client_id_of(other) == -1
        with pytest.raises(ValueError, match=re.escape(f"'{other}' is not a logical client id")):
            client_id(other)
    for other in (client_node(n), client_proc_node(n), SERVER):
        with pytest.raises(ValueError, match=re.escape(f"'{other}' is not an edge node id (expected edge-<n>)")):
            edge_index(other)


@pytest.mark.parametrize("tail", NOT_A_NUMBER)
def test_a_malformed_number_is_refused(tail):
    assert client_id_of(f"client-{tail}") == -1
    with pytest.raises(ValueError):
        client_id(f"client-{tail}")
    with pytest.raises(ValueError):
        edge_index(f"edge-{tail}")


def test_a_client_process_answers_an_id_that_names_no_client_with_a_typed_error():
    assert parse_client_id(client_node(42)) == 42
    with pytest.raises(HandlerError) as exc:
        parse_client_id(client_proc_node(4))
    assert exc.value.code == "UNKNOWN_CLIENT" and exc.value.detail == "'client-proc4' is not a logical client id"


def test_the_role_modules_build_no_node_id_inline():
    """Every `client-`/`edge-` id is built by common/util/nodeids.py (grep over the source folders)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    inline = re.compile(r"""f["'](client-proc|client-|edge-)\{""")
    found = [f"{p.relative_to(root)}:{i}" for folder in ("common", "server", "edge", "client")
             for p in sorted((root / folder).rglob("*.py")) if p.name != "nodeids.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if inline.search(line)]
    assert found == []
