"""A client process's side of secure aggregation: the four phases' handlers over the process's
per-client SecAggClient state (client/host.py `extension`), served the same under the star's
server and under an edge (the handlers of every topology that runs secure aggregation).  The
masked-input phase trains the logical client on the model it brings (ClientHost.train), flattens
the reply's delta in the model's name order, and masks it (common/security/secagg/client.py).

`secure_aggregation.dropouts` (tests and development only, docs/secure-aggregation.md) makes a
chosen client drop at a chosen phase of a chosen round: "refuse" fails that client's call (it
answers no more in that round's protocol), "exit" ends this whole process at once (os._exit)."""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from fedhop.client.host import ClientHost, parse_client_id
from fedhop.common.privacy.secure_sum import client_input
from fedhop.common.security.secagg import messages
from fedhop.common.security.secagg.client import SecAggClient
from fedhop.common.security.secagg.errors import SecAggFailure, SecAggRefusal
from fedhop.common.security.secagg.settings import dropout_plan, params_of
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.secagg_wire import BY_PHASE, PROTOCOL, flatten, unwrap, wrap
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method

log = logging.getLogger("fedhop.client")
EXIT_CODE = 70   # a process ended by an "exit" dropout


class SecAggHost:
    """The logical clients' protocol state in this process, one SecAggClient per client and round."""

    def __init__(self, host: ClientHost) -> None:
        self.host = host
        self.clients: dict[int, SecAggClient] = {}
        self.lock = threading.Lock()
        self.dropouts = dropout_plan(host.cfg.secure_aggregation.dropouts)

    def _drop(self, phase: str, round: int, cid: int) -> None:
        """The injected dropout of (round, phase, client), if the config names one."""
        action = self.dropouts.get((round, phase, cid))
        if action == "exit":
            log.warning("client %d: secure_aggregation.dropouts ends this process in round %d's %s phase",
                        cid, round, phase)
            logging.shutdown()
            os._exit(EXIT_CODE)
        if action == "refuse":
            raise HandlerError("SECAGG_DROPOUT", f"client {cid} drops in round {round}'s {phase} phase "
                                                 f"(secure_aggregation.dropouts)")

    def call(self, phase: str, request: Request) -> Payload:
        env = request.envelope
        cid = parse_client_id(env.dst)
        self._drop(phase, int(env.round), cid)
        try:
            raw = unwrap(request.payload)
            if phase == "advertise":
                _, _, n = messages.read_advertise_request(raw)
                client = SecAggClient(params_of(self.host.cfg.secure_aggregation, n, self.host.cfg.run.seed,
                                                self.host.cfg.compression))
                with self.lock:
                    self.clients[cid] = client
                return wrap(client.advertise(raw))
            with self.lock:
                client = self.clients[cid]
            if phase == "share":
                return wrap(client.share(raw))
            if phase == "masked":
                model = Payload(tensors={k: v for k, v in request.payload.tensors.items() if k != PROTOCOL},
                                scalars=dict(request.payload.scalars))
                reply = self.host.train(cid, int(env.round), model, int(env.step))
                names = sorted(model.tensors)
                flat = flatten(reply.tensors, names)
                bound, extra = client_input(self.host.cfg, client.params, model, flat)   # [privacy] (common/privacy/secure_sum.py)
                return wrap(client.masked(raw, flat, bound, extra))
            out = wrap(client.unmask(raw))
            with self.lock:
                self.clients.pop(cid, None)
            return out
        except KeyError:
            raise HandlerError("SECAGG_REFUSED", f"{phase} for client {cid} before its advertise phase") from None
        except (SecAggRefusal, SecAggFailure, ValueError) as exc:
            raise HandlerError("SECAGG_REFUSED", f"{phase}: {exc}") from None


def secagg_handlers(host: ClientHost) -> dict[Method, Callable[[Request], Payload]]:
    """The four phases' handlers, named by the star spec's `client_handlers`; a run without
    secure aggregation serves none of them."""
    if not host.cfg.secure_aggregation.enabled:
        return {}
    def handler(phase: str) -> Callable[[Request], Payload]:
        return lambda request: host.extension("secagg", SecAggHost).call(phase, request)

    return {method: handler(phase) for phase, method in BY_PHASE.items()}
