"""Pytest fixtures for emulated nodes: network namespaces with two NICs each.

The logic lives in ``scripts/emulated_nodes.py`` (a CLI as well, and kept out of
the ``hetpipe`` package because it is test infrastructure that needs root); this
module loads it and wraps it in fixtures. Use it from a test module with::

    from emulated_nodes import emu, emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401

``emulated_nodes`` is two unshaped nodes; ``make_emulated_nodes(n=..., rate=...,
delay=..., subnets=..., prefix=...)`` makes others (the arguments of
``EmulatedNodes``); ``netns_available`` only skips, for tests that manage nodes
themselves. All skip, naming what is missing, where namespaces cannot be made
(not root, no iproute2, no veth or bridge support); everything the first two made
is removed when the test ends, passed or failed, and on SIGTERM of the pytest
process. ``emu`` is the script's module: ``emu.run_in``, ``emu.shape``,
``emu.set_link``, ``emu.counters``, ``emu.EmulatedNodes``, ... See the
script's docstring for what a process inside a node sees (notably: the
hostname is the host's and resolves to loopback).
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "emulated_nodes.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hetpipe_scripts_emulated_nodes", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


emu = _load()


@pytest.fixture(scope="session")
def netns_available() -> Iterator[None]:
    """Skips where namespaces cannot be made; otherwise removes the leftovers of
    crashed earlier runs and, for the session, turns SIGTERM into an interrupt so
    that pytest still tears the nodes down."""
    reason = emu.netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated nodes unavailable: {reason}")
    emu.cleanup_stale()
    with emu.terminate_raises():
        yield


@pytest.fixture
def make_emulated_nodes(netns_available: None) -> Iterator[Callable[..., emu.EmulatedNodes]]:
    """Factory: ``make_emulated_nodes(**EmulatedNodes arguments)`` returns nodes that are up
    until the test ends."""
    with contextlib.ExitStack() as stack:
        def make(*args: Any, **kwargs: Any) -> emu.EmulatedNodes:
            return stack.enter_context(emu.EmulatedNodes(*args, **kwargs))

        yield make


@pytest.fixture
def emulated_nodes(make_emulated_nodes: Callable[..., emu.EmulatedNodes]) -> emu.EmulatedNodes:
    """Two unshaped nodes, ``hetpipe-<pid>-<token>-node{0,1}``, on 10.201.0.0/24 (eth1) and 10.202.0.0/24 (eth2)."""
    return make_emulated_nodes()
