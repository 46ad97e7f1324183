"""Two emulated nodes (network namespaces), each started with the real launcher, train like one process.

Node 0 is the "nvidia" node, node 1 the "amd" node of cluster cpu_2node (two
CPU ranks each); each has eth1 on 10.201.0.0/24 and eth2 on 10.202.0.0/24 and
its own loopback, and its host name resolves to loopback - as on a real
cluster whose /etc/hosts maps the name to 127.0.1.1. One config file serves
both nodes: each resolves its NICs from ``cluster.transport.subnets``. What a
user would notice: the losses are bitwise those of one process, the one
cross-node boundary is striped over both NICs (both counters rise), two
rate-limited NICs carry about twice what one does, and the shipped two-node
config selects each node's own address. Skipped, with the reason, where
namespaces cannot be made.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from cluster_nodes import JOB, metrics, plain_env, start_nodes, wait_all
from conftest import REPO, fork_servers_started, log_python_starts, run_pretrain
from emulated_nodes import emu, emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401

pytestmark = pytest.mark.timeout(240)

MIB = 1 << 20
STEPS = 3


@pytest.mark.torch_matrix
def test_per_node_launchers_train_bitwise_like_one_process_over_two_striped_nics(tmp_path, emulated_nodes,
                                                                                 corpus_prefix, monkeypatch):
    nics = [(node, nic) for node in emulated_nodes.nodes for nic in ("eth1", "eth2")]
    before = {key: emu.counters(*key) for key in nics}
    args = [*JOB, f"data.path={corpus_prefix}", f"train.train_iters={STEPS}"]
    usual_path = os.environ.get("PYTHONPATH")
    starts = log_python_starts(tmp_path, monkeypatch)
    runs = start_nodes(emulated_nodes, args, tmp_path)
    codes = wait_all(runs, timeout=150)
    assert codes == [0, 0], "".join(f"\n--- node {r.rank}:\n{r.output()[-3000:]}" for r in runs)
    # Each node's two ranks forked from one server that imported torch and hetpipe
    # once (hetpipe.launch.fork_server.node_rank), not two interpreters importing them each.
    started = [json.loads(line) for line in starts.read_text().splitlines()]
    assert fork_servers_started(starts) == 2, started
    modules = [argv[argv.index("-m") + 1] for argv in started if "-m" in argv]  # each interpreter's own
    assert modules.count("hetpipe.launch") == 2 and "hetpipe.pretrain" not in modules, started
    if usual_path is None:  # the worker's own environment again, for the reference run below
        monkeypatch.delenv("PYTHONPATH")
    else:
        monkeypatch.setenv("PYTHONPATH", usual_path)
    for run, node in zip(runs, emulated_nodes.nodes):
        # Each node found its own NICs from the subnets and pointed gloo at them.
        assert (f"NICs eth1 {node.addrs['eth1']}, eth2 {node.addrs['eth2']} (cluster.transport.subnets); "
                "GLOO_SOCKET_IFNAME=eth1,eth2, NCCL_SOCKET_IFNAME==eth1,eth2") in run.output()
        assert "Traceback" not in run.output()

    # The single-process reference: same model, data order and microbatches.
    _, reference = run_pretrain(tmp_path / "single", [*args, "cluster=single", "cluster.groups.0.device_type=CPU"])
    two_nodes = metrics(tmp_path / "run0")
    assert [(r["loss"], r["grad_norm"]) for r in two_nodes] == [(r["loss"], r["grad_norm"]) for r in reference]
    assert len(two_nodes) == STEPS and not metrics(tmp_path / "run1")

    # Stage 1 -> stage 2 crosses the nodes: 2 activations and 2 gradients of
    # 512 KiB per step, each in two pieces, one per NIC: 1.5 MiB each way per NIC.
    moved = {key: emu.counters(*key) for key in nics}
    for node, nic in nics:
        sent = moved[(node, nic)].tx_bytes - before[(node, nic)].tx_bytes
        received = moved[(node, nic)].rx_bytes - before[(node, nic)].rx_bytes
        print(f"node {node.rank} {nic}: sent {sent / MIB:.2f} MiB, received {received / MIB:.2f} MiB")
        assert sent > MIB and received > MIB, (node.rank, nic, sent, received)


def test_two_rate_limited_nics_carry_twice_what_one_does(make_emulated_nodes):
    # tbf at 40 Mbit/s on every NIC: the links, not two busy cores, set the pace.
    nodes = make_emulated_nodes(rate="40mbit")
    env = {"HETPIPE_JOB_TOKEN": secrets.token_hex(32), "PYTHONUNBUFFERED": "1"}
    before = [emu.counters(nodes[1], nic) for nic in ("eth1", "eth2")]
    procs = [emu.run_in(node, [sys.executable, str(REPO / "scripts" / "bench_channel.py"), "--rank", str(node.rank),
                               "--store", f"{nodes[0].addrs['eth1']}:29500", "--interfaces", "eth1,eth2",
                               "--streams", "1", "--sizes", "1MiB", "--budget-mib", "8", "--time-limit", "90"],
                        env={**plain_env(), **env}, cwd=REPO, text=True, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
             for node in nodes.nodes]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(outs)
    rows = {int(row[1]): float(row[-1]) for row in (line.split() for line in outs[0].splitlines())
            if len(row) == 5 and row[0] == "tcp"}
    print(f"one NIC (eth1): {rows[1]:.1f} MB/s; two NICs (eth1+eth2): {rows[2]:.1f} MB/s; "
          f"{rows[2] / rows[1]:.2f}x")
    assert rows[2] >= 1.6 * rows[1], outs[0]
    received = [emu.counters(nodes[1], nic).rx_bytes - b.rx_bytes for nic, b in zip(("eth1", "eth2"), before)]
    # eth1 carried the one-NIC run and half the two-NIC run, eth2 the other half.
    assert received[1] > 4 * MIB and received[0] > received[1], received


def test_the_shipped_two_node_config_selects_each_nodes_own_address(make_emulated_nodes):
    # h200_mi325x_2node names its NICs by subnet (10.100.0.0/16); node k has 10.100.0.k+1.
    nodes = make_emulated_nodes(subnets=["10.100.0.0/16"])
    env = {**plain_env(), "HETPIPE_JOB_TOKEN": secrets.token_hex(32), "RDZV_ENDPOINT": "10.100.0.1:29400"}
    for node in nodes.nodes:
        proc = emu.run_in(node, [sys.executable, "-m", "hetpipe.launch.scheduler_env", "--", "cluster=h200_mi325x_2node"],
                          env={**env, "NODE_RANK": str(node.rank)}, cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"export HETPIPE_LOCAL_ADDR={node.addrs['eth1']}" in out.splitlines()
    # The old setting, a wildcard, is refused before anything starts, naming the setting.
    proc = emu.run_in(nodes[0], [sys.executable, "-m", "hetpipe.launch.scheduler_env", "--", "cluster=h200_mi325x_2node",
                                 "cluster.transport.subnets=null", "cluster.transport.addresses=[0.0.0.0]"],
                      env={**env, "NODE_RANK": "0"}, cwd=REPO, text=True, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        "hetpipe: error: cluster.transport.addresses gives 0.0.0.0, a wildcard address that peers cannot dial: "
        "select NICs with cluster.transport.interfaces=[NAME,...] or cluster.transport.subnets=[CIDR,...]")
