"""Every store value that decides what a rank does is sealed with the job secret (issue 32).

Beside the verdict (tests/test_forged_verdicts.py), three kinds of value in
the job's store steer ranks: the roll call (the addresses ranks dial and the
devices they plan for), the direct channel's mover facts (which mover both
ends of a boundary run) and the checkpoint board (which ranks commit what).
Anyone who reaches the store's port can write them; a value the job did not
seal now stops the rank in one line naming the key, rather than being acted on.
Each test writes a forged value the way such a process would - plain JSON in
the format the code read before - into a real c10d store.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from hetpipe.checkpoint.board import StoreBoard
from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.comm.channel import ChannelError
from hetpipe.comm.factory import MoverFacts, exchange_mover_facts
from hetpipe.launch.nodes import NodeMap, roll_call
from hetpipe.launch.store_seal import ForgedStoreValue, Seal

SECRET = "9f3c1ab27e8d4c6b05a1f2e3d4c5b6a7988796a5b4c3d2e1f0a9b8c7d6e5f4a3"
NAMES = {0: "stage 0 (rank 0)", 1: "stage 1 (rank 1)"}


def _layout() -> NodeMap:
    cluster = ClusterConfig(name="two", groups=[GroupConfig(name="nvidia", vendor="nvidia", device_type="CPU"),
                                                GroupConfig(name="amd", vendor="amd", device_type="CPU")])
    return NodeMap.layout(cluster, multi_node=False)


def test_a_roll_call_entry_the_job_did_not_seal_stops_the_rank_naming_it():
    store, seal = dist.HashStore(), Seal(SECRET, 0)
    # What a forger on the network writes: rank 1 "lives" at an address of its choosing.
    store.set("hetpipe/roll_call/1", json.dumps({"addresses": ["10.66.6.6"], "network": "x", "device": None}))
    with pytest.raises(ForgedStoreValue) as caught:
        roll_call(store, 0, _layout(), ["127.0.0.1"], 5.0, lambda: None, seal=seal)
    line = str(caught.value)
    assert "the roll-call entry of rank 1 (hetpipe/roll_call/1)" in line and "not this job's" in line
    assert "10.66.6.6" not in line and "\n" not in line


def test_sealed_roll_calls_of_the_same_job_agree():
    store, maps = dist.HashStore(), {}

    def answer(rank):
        maps[rank] = roll_call(store, rank, _layout(), [f"127.0.0.{rank + 1}"], 10.0, lambda: None,
                               seal=Seal(SECRET, 0))

    other = threading.Thread(target=answer, args=(1,))
    other.start()
    answer(0)
    other.join()
    assert maps[0].addresses == maps[1].addresses == {0: ("127.0.0.1",), 1: ("127.0.0.2",)}
    # A seal of another secret (another job sharing the store) is not this job's either.
    with pytest.raises(ForgedStoreValue):
        roll_call(store, 0, _layout(), ["127.0.0.1"], 5.0, lambda: None, seal=Seal(SECRET[::-1], 0))


def test_forged_mover_facts_stop_the_channel_instead_of_choosing_its_mover():
    store, seal = dist.HashStore(), Seal(SECRET, 0)
    mine = MoverFacts(network="host-a", runtime="cuda", rdma=None)
    # The forger claims rank 1 shares rank 0's host, steering both ends to another mover.
    store.set("hetpipe/direct_facts/1", json.dumps({"network": "host-a", "runtime": "cuda", "rdma": None}))
    with pytest.raises(ChannelError) as caught:
        exchange_mover_facts(store, 0, [1], mine, NAMES, 5.0, seal)
    assert "stage 1 (rank 1)'s direct-mover facts (hetpipe/direct_facts/1)" in str(caught.value)
    # The peer's own sealed facts are read as before.
    store.set("hetpipe/direct_facts/1", seal.seal_text("hetpipe/direct_facts/1", json.dumps(
        {"network": "host-b", "runtime": "cuda", "rdma": "no RDMA NIC"})))
    assert exchange_mover_facts(store, 0, [1], mine, NAMES, 5.0, seal)[1].network == "host-b"


def test_a_forged_checkpoint_board_value_fails_the_save_in_one_line(tmp_path: Path):
    store = dist.HashStore()
    boards = [StoreBoard(store, r, 2, wait_s=5.0, seal=Seal(SECRET, 0)) for r in range(2)]
    assert boards[0].prefix != boards[1].prefix  # each StoreBoard numbers itself; make them one board's
    boards[1].prefix = boards[0].prefix
    # Rank 1's holdings as a forger writes them (the board's JSON, unsealed).
    store.set(boards[0]._key("holdings", 1), json.dumps({"model/embed": {"bytes": 1}}))
    boards[0]._set(boards[0]._key("holdings", 0), json.dumps({}))
    with pytest.raises(CheckpointError) as caught:
        boards[0]._gather("holdings", [0, 1], "exchanging what each rank holds")
    assert "holdings/1 in the job's store is not this job's" in str(caught.value)
