"""A one-host job listens on loopback only: the launcher's stores, and every rank's sockets.

torch's TCPStore listens on every interface, and a one-host launch asked for
127.0.0.1:0 still had its rendezvous store and the store its ranks share (the
verdict, the channels' endpoints) on all of them, for anyone on the network
(hetpipe/launch/store_bind.py).
"""
from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from listening import listening, process_tree
from test_launcher_restart import TINY, wait_for_steps

pytestmark = pytest.mark.timeout(180)


def test_every_socket_a_one_host_job_listens_on_is_loopback(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hetpipe.pretrain", *TINY, "train.train_iters=100000",
                             f"hydra.run.dir={run}"], cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_steps(proc, run, 2)
        sockets = listening(process_tree(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    launcher = {(address, port) for pid, address, port in sockets if pid == proc.pid}
    ranks = {pid for pid, _, _ in sockets if pid != proc.pid}
    print(f"listening: {sorted(sockets)}")
    # Its two stores in the launcher, a boundary channel's listener in each rank.
    assert len(launcher) >= 2 and len(ranks) >= 2, sockets
    assert all(ipaddress.ip_address(address).is_loopback for _, address, _ in sockets), sorted(sockets)
