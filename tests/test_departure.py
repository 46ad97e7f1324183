"""A launcher that hosts the job's stores leaves after the other nodes (hetpipe/launch/departure.py),
so that no node's last store calls meet a closed server; the two-node fault tests
(tests/test_node_faults.py, tests/test_nic_faults.py) check that no C++ frames are printed."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from hetpipe.launch import departure
from hetpipe.launch.store_bind import bound_store


def _client(server: dist.TCPStore) -> dist.Store:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    return dist.PrefixStore("attempt0", client)


def test_the_host_waits_for_every_node_and_the_others_do_not():
    server = bound_store("127.0.0.1")
    host, other = _client(server), _client(server)
    started = time.monotonic()
    threading.Timer(0.6, lambda: departure.leave_in_order(other, "other", 2, hosting=False)).start()
    assert departure.leave_in_order(host, "host", 2, hosting=True)
    assert 0.6 <= time.monotonic() - started < departure.WAIT_S
    # A node that does not host leaves at once, whether or not the others marked.
    started = time.monotonic()
    assert not departure.leave_in_order(_client(server), "late", 4, hosting=False)
    assert time.monotonic() - started < 0.5


def test_a_node_that_never_marks_delays_the_host_by_the_wait_only(monkeypatch):
    monkeypatch.setattr(departure, "WAIT_S", 0.5)
    server = bound_store("127.0.0.1")
    started = time.monotonic()
    assert not departure.leave_in_order(_client(server), "host", 2, hosting=True)
    assert 0.5 <= time.monotonic() - started < 2.0


def test_a_store_that_does_not_answer_is_left_without_waiting(monkeypatch):
    answered = threading.Event()

    class Unanswering:
        def add(self, key: str, value: int) -> int:
            answered.wait(10)  # a request on a route that went down
            return 0

    started = time.monotonic()
    assert not departure.leave_in_order(Unanswering(), "10.201.0.1:29400", 2, hosting=True)
    answered.set()
    assert time.monotonic() - started < 2.0
