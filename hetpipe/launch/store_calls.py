"""Requests to the job's store that end when they should, whatever the network does.

torch's TCPStore client does not bound every request by its timeout: a
request sent over a connection whose route has gone (the NIC that leads to
the store taken down) waits for the kernel to give up on the connection,
which takes TCP's retransmission timeout - about 15 minutes. Measured on
two emulated nodes (issue 32): with the watch's client at a 15 s timeout, a
``store.check`` stayed blocked for 9.7 minutes, until the node was killed,
and every thread that waited on its lock waited with it.

So a client is driven by a thread of its own (:class:`BoundedClient`):
callers queue a request and wait for its answer for at most their limit,
holding no lock while they wait; a request that is in progress longer than
the client's limit marks the store as lost, and every later request fails
at once. The thread stuck in the request stays behind (a daemon: the rank
ends with ``os._exit`` anyway). :func:`call_within` does the same for one
request on a client of someone else's (the launcher's), with a thread per
request.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Generic, Optional, TypeVar

from hetpipe.errors import EXIT_LOST_PEER, HetpipeError

T = TypeVar("T")

# How finely a waiting caller checks whether the request in progress overran.
_CHECK_S = 0.05


class StoreUnanswered(HetpipeError):
    """The store did not answer a request within the time given to it (or failed before):
    its host, or the way to it, is gone - the cluster's failure, as a lost peer is."""

    exit_status = EXIT_LOST_PEER


class Request(Generic[T]):
    """One queued request: its function of the client, and its answer once it came."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Optional[T] = None
        self.error: Optional[BaseException] = None

    def answer(self) -> T:
        """The request's value, or its exception raised here (only once :attr:`done`)."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class BoundedClient:
    """A store client whose requests run, one at a time in order, on a thread of its own.

    ``limit`` (seconds) is how long a request may take before the store counts
    as lost; ``where`` names the store in errors (``10.201.0.1:29400``).
    """

    def __init__(self, client: Any, limit: float, where: str, name: str = "hetpipe-store") -> None:
        self.limit = limit
        self.where = where
        self._client = client
        self._requests: queue.SimpleQueue[Request[Any]] = queue.SimpleQueue()
        self._busy_since: Optional[float] = None  # time.monotonic() the request in progress started
        self._failure: Optional[str] = None
        threading.Thread(target=self._serve, daemon=True, name=name).start()

    # -- callers -------------------------------------------------------------------
    def submit(self, fn: Callable[[Any], T]) -> Request[T]:
        """Queue ``fn(client)`` and return at once."""
        request: Request[T] = Request(fn)
        self._requests.put(request)
        return request

    def call(self, fn: Callable[[Any], T], wait: Optional[float] = None) -> T:
        """``fn(client)``'s answer; :class:`StoreUnanswered` once the store is lost, or after
        ``wait`` seconds (default: the limit) without an answer."""
        self.check()
        return self.result(self.submit(fn), wait)

    def result(self, request: Request[T], wait: Optional[float] = None) -> T:
        """``request``'s answer, waiting as :meth:`call` does."""
        given = self.limit if wait is None else wait
        until = time.monotonic() + given
        while not request.done.wait(_CHECK_S):
            self.check()
            if time.monotonic() >= until:
                raise StoreUnanswered(f"the job's store at {self.where} gave no answer within {given:.3g} s")
        return request.answer()

    def check(self) -> None:
        """Raise :class:`StoreUnanswered` if the store is lost: a request failed, or overran the limit."""
        failure = self.failure()
        if failure is not None:
            raise StoreUnanswered(failure)

    def failure(self) -> Optional[str]:
        """Why the store counts as lost (None while it answers)."""
        since = self._busy_since
        if self._failure is None and since is not None and time.monotonic() - since > self.limit:
            self._failure = f"the job's store at {self.where} did not answer within {self.limit:g} s"
        return self._failure

    # -- the client's thread ---------------------------------------------------------
    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if self._failure is not None:
                request.error = StoreUnanswered(self._failure)
                request.done.set()
                continue
            self._busy_since = time.monotonic()
            try:
                request.value = request.fn(self._client)
            except Exception as exc:  # noqa: BLE001 - any failure of the client: the store is lost
                request.error = exc
                self._failure = f"the job's store at {self.where} stopped answering ({_gist(exc)})"
            finally:
                self._busy_since = None
                request.done.set()


def call_within(fn: Callable[[], T], limit: float, where: str) -> T:
    """``fn()`` (one request of a store client) on a thread of its own; its answer, or
    :class:`StoreUnanswered` after ``limit`` seconds, leaving the thread behind."""
    request: Request[T] = Request(lambda _: fn())
    thread = threading.Thread(target=_run_one, args=(request,), daemon=True, name="hetpipe-store-call")
    thread.start()
    if not request.done.wait(limit):
        raise StoreUnanswered(f"the job's store at {where} did not answer within {limit:g} s")
    return request.answer()


def _run_one(request: Request[Any]) -> None:
    try:
        request.value = request.fn(None)
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        request.error = exc
    finally:
        request.done.set()


def _gist(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
