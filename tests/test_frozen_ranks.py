"""The launcher's notes of stopped ranks (hetpipe/launch/frozen_ranks.py): kept while a rank
is stopped, dropped when it runs again, sealed so that a forged one names nobody. The job
that a frozen rank ends is in tests/test_launcher_restart.py."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from hetpipe.launch.frozen_ranks import FrozenNotes, frozen_in
from hetpipe.launch.hung_ranks import process_state
from hetpipe.launch.store_seal import Seal


class DictStore:
    """The store calls the notes make, on a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def _wait_for_state(pid: int, states: tuple[str, ...]) -> None:
    until = time.monotonic() + 10
    while process_state(pid) not in states:
        assert time.monotonic() < until, process_state(pid)
        time.sleep(0.01)


def test_a_stopped_rank_is_noted_while_stopped_and_named_in_one_line():
    seal, store = Seal("s" * 64, 0), DictStore()
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        notes = FrozenNotes(store, seal, {sleeper.pid: 3}, node="node 1 of 2: ")
        notes.sweep()
        assert frozen_in(store, seal, 4) is None
        sleeper.send_signal(signal.SIGSTOP)
        _wait_for_state(sleeper.pid, ("T", "t"))
        notes.sweep()
        frozen = frozen_in(store, seal, 4)
        assert (frozen.rank, frozen.pid) == (3, sleeper.pid)
        assert frozen.line(now=frozen.since + 10.04) == (
            f"node 1 of 2: rank 3 (pid {sleeper.pid}) stopped responding: its process has been stopped "
            "(SIGSTOP, a debugger) for 10.0 s")
        assert frozen_in(store, Seal("t" * 64, 0), 4) is None  # sealed by another secret: nobody is named
        assert frozen_in(store, Seal("s" * 64, 1), 4) is None  # or for another attempt
        sleeper.send_signal(signal.SIGCONT)
        _wait_for_state(sleeper.pid, ("S", "R"))
        notes.sweep()
        assert frozen_in(store, seal, 4) is None and not store.values
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_rank_that_dies_stopped_keeps_its_note_without_a_store_call():
    seal, store = Seal("s" * 64, 0), DictStore()
    sleeper = subprocess.Popen(["sleep", "30"])
    notes = FrozenNotes(store, seal, {sleeper.pid: 1})
    sleeper.send_signal(signal.SIGSTOP)
    _wait_for_state(sleeper.pid, ("T", "t"))
    notes.sweep()
    sleeper.kill()
    sleeper.wait()
    store.delete_key = pytest.fail  # the store may be closing with the attempt
    notes.sweep()
    assert frozen_in(store, seal, 2).rank == 1
