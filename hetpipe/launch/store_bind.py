"""The launcher's stores listen where the job reaches them, not on every interface.

A launch has two TCPStores, both in the launcher (node 0's under torchrun):
the c10d rendezvous store, and the store torch's agent shares with the ranks
(``MASTER_ADDR``/``MASTER_PORT``: their roll call, gloo's bootstrap, the
channels' endpoints, the job's verdict). torch's TCPStore takes no bind
address and listens on all of them, so a one-host job asked for
``127.0.0.1:0`` answered anyone on the network. Its constructor does take a
socket that is already listening (``master_listen_fd``, every supported
release); so the launcher binds one itself, on the address the store's
clients are told to dial:

* the rendezvous store (:func:`host_rendezvous_store`): on the endpoint's
  host, when this node hosts it. The launcher creates it first, as a
  ``multi_tenant`` store, and torch's c10d backend, which creates its own
  multi-tenant store on the same port, gets that server (TCPStore keeps one
  server per port in a process). A port of 0 is chosen here and written
  into the endpoint.
* the agent's store (:func:`agent_store`): on the address the ranks are given
  as ``MASTER_ADDR`` - torch's agent makes it through the rendezvous
  handler, which :func:`hetpipe.process.torch_compat.make_agent_store_with` points here.

A one-host job binds loopback. A job on several nodes binds the address the
other nodes dial - an IP address of this node (launch_cluster.sh gives
``--local-addr``, this node's first NIC), or what a host name resolves to
here, except loopback: a name /etc/hosts maps to 127.0.1.1 names another
address on the other nodes, and there (or where the name resolves to no
address of this node) the store keeps torch's all interfaces. What a store
on all interfaces exposes - keys anyone who reaches it may read and write -
is why nothing in it is trusted but addresses: the channels authenticate
each connection with the job secret (comm/handshake.py).
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from hetpipe.process.torch_compat import make_agent_store_with

log = logging.getLogger(__name__)

# A listening socket's queue: torch's own TCPStore server asks for as much
# (its backlog), for every rank of a large job dialling at once.
_BACKLOG = 4096
# The rendezvous store's clients wait this long for a key (torch's c10d
# backend: read_timeout, default 60 s); the store created here is its server.
_DEFAULT_TIMEOUT_S = 60.0


def bind_address(host: str, multi_node: bool) -> Optional[str]:
    """The address of this node to bind a store that its clients reach at ``host``; None where
    it must keep all interfaces (see the module)."""
    literal = _is_ip(host)
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in found:
        address = sockaddr[0]
        if multi_node and not literal and ipaddress.ip_address(address.split("%")[0]).is_loopback:
            continue
        if _bindable(family, address):
            return address
    return None


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``address``:``port`` (0: any free port) and listening."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(address: str, port: int = 0, timeout_s: float = _DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A multi-tenant TCPStore server listening on ``address`` only (it owns the socket)."""
    sock = listening_socket(address, port)
    port = sock.getsockname()[1]
    return dist.TCPStore(address, port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(),
                         timeout=timedelta(seconds=timeout_s))


def host_rendezvous_store(params: Any) -> Optional[dist.TCPStore]:
    """Before torch's c10d backend makes its store from ``params`` (torch's RendezvousParameters):
    if this node hosts it, a bound one on its port, which torch then shares; ``params.endpoint``
    gets the port chosen for a port of 0. The store is to be kept while the launch runs."""
    if params.backend != "c10d" or params.get_as_bool("is_host") is False:
        return None
    host, _, port = params.endpoint.rpartition(":")
    host = host.strip("[]")
    address = bind_address(host, params.max_nodes > 1) if host and port.isdigit() else None
    if address is None:
        return None
    try:
        store = bound_store(address, int(port), float(params.get("read_timeout", _DEFAULT_TIMEOUT_S)))
    except OSError as exc:  # another process on this machine hosts it: torch's backend then dials it
        log.debug("rendezvous store not hosted on %s:%s: %s", address, port, exc)
        return None
    if int(port) == 0:
        params.endpoint = f"[{host}]:{store.port}" if ":" in host else f"{host}:{store.port}"
    if params.max_nodes == 1 and not params.local_addr and ipaddress.ip_address(address.split("%")[0]).is_loopback:
        params.local_addr = address  # the ranks' MASTER_ADDR, and so the agent's store, on loopback too
    return store


class BoundStores:
    """torch's rendezvous registry as ``launch_agent`` uses it (``get_rendezvous_handler``), but
    each c10d handler's stores listen on the job's addresses (see the module); ``kept`` holds the
    stores made here (this node hosts them) for as long as the launch runs."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self.kept: list[dist.TCPStore] = []

    def get_rendezvous_handler(self, params: Any) -> Any:
        store = host_rendezvous_store(params)
        if store is not None:
            self.kept.append(store)
        handler = self._registry.get_rendezvous_handler(params)
        make = agent_store(params.max_nodes > 1)
        make_agent_store_with(handler, lambda host, port: self._keep(make(host, port)))
        return handler

    @property
    def hosting(self) -> bool:
        """Whether this node hosts a store of the launch (the rendezvous store, or the agent's)."""
        return bool(self.kept)

    def _keep(self, store: dist.TCPStore) -> dist.TCPStore:
        self.kept.append(store)
        return store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


def agent_store(multi_node: bool) -> Callable[[str, int], dist.TCPStore]:
    """What makes the store torch's agent shares with the ranks, from the address they are
    given (``MASTER_ADDR``) and the port (0: any)."""
    def make(host: str, port: int) -> dist.TCPStore:
        address = bind_address(host, multi_node)
        if address is None:
            log.debug("the agent's store listens on all interfaces: %s names no address of this node", host)
            return dist.TCPStore(host_name=host, port=port, is_master=True, multi_tenant=True)
        return bound_store(address, port)
    return make


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True


def _bindable(family: int, address: str) -> bool:
    """Whether ``address`` is one of this node's (a bind to it succeeds)."""
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return True
    return False
