"""``python -m hetpipe.doctor``: the report a user reads before starting a job.

Single node: the table and exit 0 on a clean config; one blocker line each
and exit 1 for what this node lacks; exit 2 for a bad command line. Several
nodes: two torchrun "nodes" on this host, with the test hooks of
hetpipe/doctor/facts.py faking a torch version or another host on one of them.
``run_nodes`` takes a command prefix per node, so the same tests can run the
nodes inside network namespaces (``ip netns exec NS``).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_cli, torchrun
from hetpipe.comm.nics import Nic
from hetpipe.doctor.facts import config_hash, file_digest
from hetpipe.doctor.probe import ProbeServer, probe
from hetpipe.doctor.report import blockers_of, torch_lines

JOB = ["cluster=cpu_mixed", "+model=tiny_llama", "data=demo"]
BLOCKER = "hetpipe doctor: blocker: "


def doctor(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(["-m", "hetpipe.doctor", *args], cwd=cwd, timeout=120)


def blockers(stdout: str) -> list[str]:
    return [line[len(BLOCKER):] for line in stdout.splitlines() if line.startswith(BLOCKER)]


# ---------------------------------------------------------------- one node, no torchrun

@pytest.mark.torch_matrix
def test_a_clean_node_prints_its_table_and_exits_0(tmp_path):
    proc = doctor(JOB, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("hetpipe doctor: node 0 of 1, host ")
    for row in ("hetpipe ", "torch ", "GPUs ", "NICs ", "selected   cluster.transport.addresses: lo 127.0.0.1; "
                "GLOO_SOCKET_IFNAME=lo", "RDMA ", "GPU RDMA ", "not verified on RDMA hardware",
                "config ", "(cluster cpu_mixed, model tiny_llama)", "data       built-in demo corpus",
                "tokenizer  byte (built-in)"):
        assert row in out, row
    assert any(line.split()[:1] == ["lo"] and "stripe 0" in line for line in out.splitlines())
    assert out.rstrip().endswith("hetpipe doctor: ok: a job can start")
    assert not blockers(out) and not list(tmp_path.iterdir())  # a check writes nothing


def test_what_this_node_lacks_is_one_blocker_line_each_and_exit_1(tmp_path):
    (tmp_path / "corpus.idx").write_bytes(b"index")
    # The shipped config selects NICs by subnet; a wildcard address is what
    # the doctor must refuse, so it is given explicitly here.
    proc = doctor(["cluster=h200_mi325x_2node", "cluster.transport.subnets=null",
                   "cluster.transport.addresses=[0.0.0.0]", f"data.path={tmp_path / 'corpus'}",
                   f"data.tokenizer={tmp_path / 'no_tokenizer'}"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "corpus.idx: sha256 " in proc.stdout and "(whole file, 5 bytes)" in proc.stdout
    assert blockers(proc.stdout)[:3] == [
        "node 0: cluster.transport.addresses gives 0.0.0.0, a wildcard address that peers cannot dial: select NICs "
        "with cluster.transport.interfaces=[NAME,...] or cluster.transport.subnets=[CIDR,...]",
        f"node 0: data file {tmp_path / 'corpus.bin'} is missing: put the same corpus on every node (data.path)",
        f"node 0: tokenizer directory {tmp_path / 'no_tokenizer'} is missing: put the same tokenizer on every node "
        "(data.tokenizer)"]
    no_gpu = [] if torch.cuda.is_available() else [
        f"node 0: cluster 'h200_mi325x_2node' group '{name}' runs on {kind} GPUs but this node has none (torch "
        f"{torch.__version__} sees no GPU): run it where the GPUs are, or set cluster.groups.{i}.device_type=auto "
        "and cluster.allow_cpu=true to run it on the CPU (cluster=cpu_mixed is the emulated CPU cluster)"
        for i, (name, kind) in enumerate([("nvidia", "H200"), ("amd", "MI325X")])]
    assert blockers(proc.stdout)[3:] == no_gpu
    assert proc.stdout.rstrip().endswith(f"hetpipe doctor: {3 + len(no_gpu)} blockers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_cluster_on_a_node_without_gpus_is_a_blocker_not_ok(tmp_path):
    proc = doctor(["cluster=gpu2_mixed", "+model=tiny_llama"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [line.split(" runs on ")[0] for line in blockers(proc.stdout)] == [
        "node 0: cluster 'gpu2_mixed' group 'nvidia'", "node 0: cluster 'gpu2_mixed' group 'amd'"]
    assert "but this node has none" in proc.stdout and "cluster.allow_cpu=true" in proc.stdout
    assert "ok: a job can start" not in proc.stdout
    asked = doctor(["cluster=gpu2_mixed", "+model=tiny_llama", "cluster.allow_cpu=true"], tmp_path)
    assert asked.returncode == 0 and asked.stdout.rstrip().endswith("ok: a job can start"), asked.stdout


def test_a_bad_command_line_is_the_usual_one_line_error_and_exit_2(tmp_path):
    proc = doctor(["cluster=cpu_mixed", "cluster.transport.subnets=[10.201.0/33]"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("hetpipe: error: cluster.transport.subnets has '10.201.0/33', which is not a "
                                   "CIDR such as 10.201.0.0/24")


# ---------------------------------------------------------------- pieces

def test_probe_measures_a_peer_that_knows_its_nonce_and_names_what_fails():
    server = ProbeServer(["127.0.0.1"], "00" * 8, io_timeout_s=10)
    try:
        endpoint = tuple(server.endpoints[0])
        good = probe(Nic("lo", "127.0.0.1"), endpoint, "00" * 8, 2, 0.05, 10)
        assert good["ok"] and good["mb_per_s"] > 0 and not good["tx_short"]
        foreign = probe(Nic("lo", "127.0.0.1"), endpoint, "11" * 8, 2, 0.05, 10)
        assert foreign == {"ok": False, "error": "the listener there is not that node's doctor"}
    finally:
        server.close()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert probe(Nic("lo", "127.0.0.1"), ("127.0.0.1", port), "00" * 8, 2, 0.05, 10) == \
        {"ok": False, "error": "Connection refused"}


def test_large_files_are_hashed_by_size_and_ends(tmp_path, monkeypatch):
    monkeypatch.setattr("hetpipe.doctor.facts.WHOLE_FILE_BYTES", 1 << 20)
    data = bytearray(3 << 20)
    (tmp_path / "a.bin").write_bytes(data)
    data[-1] = 1
    (tmp_path / "b.bin").write_bytes(data)
    a, b = file_digest(tmp_path / "a.bin"), file_digest(tmp_path / "b.bin")
    assert a["method"] == "size + first and last MiB" and a["bytes"] == 3 << 20
    assert a["sha256"] != b["sha256"]


def test_the_config_hash_ignores_only_what_may_differ_per_node():
    job = {"cluster": {"name": "c", "transport": {"addresses": ["10.0.0.1"], "interfaces": None, "subnets": None}},
           "data": {"path": "/a/corpus", "tokenizer": "byte"}, "train": {"seq_length": 128},
           "doctor": {"timeout_s": 120.0}}
    base = config_hash(OmegaConf.create(job))
    other_node = OmegaConf.create(job)
    other_node.cluster.transport.addresses = ["10.0.0.2"]
    other_node.cluster.transport.interfaces = ["ens3"]
    other_node.data.path = "/mnt/b/corpus"
    other_node.doctor.timeout_s = 5.0
    assert config_hash(other_node) == base
    other_job = OmegaConf.create(job)
    other_job.train.seq_length = 256
    assert config_hash(other_job) != base


def sheet(node: int, **changes) -> dict:
    """A fact sheet as a node of a clean two-node job publishes it."""
    facts = {"node": node, "nodes": 2, "label": ["nvidia", "amd"][node], "host": f"h{node}",
             "network": f"n{node}", "hetpipe": "0.1.0", "torch": "2.13.0+cu128", "build": "CUDA 12.8",
             "selection": "cluster.transport.interfaces", "nics": [{"name": "eth1", "address": f"10.201.0.{node}"}],
             "config": "abc", "data": {"summary": "/d/c", "files": {"/d/c.idx": {"sha256": "i"},
                                                                    "/d/c.bin": {"sha256": "b"}}, "missing": []},
             "tokenizer": {"digest": "byte"}, "blockers": []}
    return {**facts, **changes}


def test_nodes_that_differ_from_node_0_are_blockers_naming_both():
    clean = {0: sheet(0), 1: sheet(1)}
    assert blockers_of(clean, [], multi_node=True) == []
    odd = sheet(1, hetpipe="0.2.0", torch="2.10.1+rocm6.3", build="ROCm 6.3", config="def",
                tokenizer={"digest": "x"},
                data={"summary": "/e/c", "files": {"/e/c.idx": {"sha256": "i"}, "/e/c.bin": {"sha256": "B"}},
                      "missing": []},
                nics=[{"name": "eth1", "address": "10.201.0.1"}, {"name": "eth2", "address": "10.202.0.1"}])
    assert blockers_of({0: sheet(0), 1: odd}, [], multi_node=True) == [
        "node 1 (amd) runs torch 2.10.1+rocm6.3 (ROCm 6.3 build), outside the releases hetpipe supports (2.11 to "
        "2.15): install one of them on this node",
        "node 1 (amd) runs hetpipe 0.2.0, node 0 (nvidia) runs 0.1.0: install the same hetpipe on every node",
        "node 1 (amd) composed config def, node 0 (nvidia) abc: give every node the same command line (only NIC "
        "addresses/interfaces and data paths may differ)",
        "node 1 (amd) has other data than node 0 (nvidia) (.bin differs): put the same corpus on every node",
        "node 1 (amd) has another tokenizer than node 0 (nvidia): put the same tokenizer on every node",
        "node 1 (amd) selects 2 NICs, node 0 (nvidia) 1: select the same number on every node "
        "(cluster.transport.interfaces)"]
    # Releases may differ between nodes (tests/test_mixed_releases.py: the evidence); one line per node.
    rocm = sheet(1, torch="2.15.0+rocm7.1", build="ROCm 7.1")
    assert blockers_of({0: sheet(0), 1: rocm}, [], multi_node=True) == []
    assert torch_lines({0: sheet(0), 1: rocm}) == [
        "node 0 (nvidia): torch 2.13.0+cu128 (CUDA 12.8 build): supported; nodes may run different supported releases",
        "node 1 (amd): torch 2.15.0+rocm7.1 (ROCm 7.1 build): supported; nodes may run different supported releases"]
    assert torch_lines(clean)[1] == "node 1 (amd): torch 2.13.0+cu128 (CUDA 12.8 build): supported"
    unreachable = {"src": 0, "dst": 1, "ok": False, "error": "timed out", "endpoint": ["10.201.0.1", 4000],
                   "src_nic": {"name": "eth1", "address": "10.201.0.0"}, "dst_nic": {"name": "eth1"}}
    assert blockers_of(clean, [unreachable], multi_node=True) == [
        "node 0 (nvidia) cannot reach node 1 (amd) at 10.201.0.1:4000 (eth1) from eth1 10.201.0.0: timed out: "
        "check the route and firewall between these NICs"]


# ---------------------------------------------------------------- two torchrun nodes on this host

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(args: list[list[str]], envs: list[dict[str, str]], cwd: Path, host: str = "127.0.0.1",
              prefixes: list[list[str]] | None = None,
              launcher_args: list[list[str]] | None = None) -> list[subprocess.CompletedProcess]:
    """One torchrun per node (``--nproc-per-node 1``, c10d rendezvous at ``host``):
    node K runs ``prefixes[K] torchrun launcher_args[K] ... -m hetpipe.doctor args[K]``
    with ``envs[K]`` added to the environment. c10d numbers the nodes in the order of
    their addresses (then process ids): without launcher_args node K gives 127.0.0.K+1,
    so torchrun's node K is node K, however fast each starts."""
    port = free_port()
    procs = []
    for k, (node_args, node_env) in enumerate(zip(args, envs)):
        cmd, env = torchrun([*(launcher_args[k] if launcher_args else ["--local-addr", f"127.0.0.{k + 1}"]),
                             "--nnodes", str(len(args)),
                             "--node-rank", str(k), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"{host}:{port}", "-m", "hetpipe.doctor", *node_args],
                            dict(os.environ, PYTHONUNBUFFERED="1", **node_env))
        cmd = [*(prefixes[k] if prefixes else []), *cmd]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


@pytest.mark.torch_matrix
def test_two_clean_nodes_compare_and_measure_each_nic_pair(tmp_path):
    nodes = run_nodes([JOB, JOB], [{}, {}], tmp_path)
    for k, proc in enumerate(nodes):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert out.startswith(f"hetpipe doctor: node {k} ({['nvidia', 'amd'][k]}) of 2, host ")
        assert "hetpipe doctor: 2 nodes reported" in out
        assert "NIC pairs: TCP connect, then 0.5 s of traffic" in out
        pairs = [line.split() for line in out.splitlines() if line.startswith("    node ")]
        assert [(p[1], p[5]) for p in pairs] == [("0", "1"), ("1", "0")]
        assert all(p[-1] == "MB/s" and float(p[-2]) > 0 for p in pairs)
        assert out.rstrip().endswith("hetpipe doctor: ok: a job can start")


def test_a_node_takes_its_place_from_the_cluster_config_not_from_torchrun(tmp_path):
    # torchrun's c10d rendezvous numbers the nodes by address (run_nodes);
    # launch_cluster.sh exports each node's index in the config's group
    # order: the node torchrun places first is the config's node 1 (amd).
    placed = [{"HETPIPE_NODE_RANK": "1", "HETPIPE_FIRST_RANK": "1"},
              {"HETPIPE_NODE_RANK": "0", "HETPIPE_FIRST_RANK": "0"}]
    nodes = run_nodes([JOB, JOB], placed, tmp_path)
    for k, proc in enumerate(nodes):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        me = 1 - k
        assert out.startswith(f"hetpipe doctor: node {me} ({['nvidia', 'amd'][me]}) of 2, host ")
        assert "hetpipe doctor: 2 nodes reported" in out
        pairs = [line.split() for line in out.splitlines() if line.startswith("    node ")]
        assert [(p[1], p[5]) for p in pairs] == [("0", "1"), ("1", "0")]
        assert out.rstrip().endswith("hetpipe doctor: ok: a job can start")


def test_each_problem_of_an_odd_node_is_a_blocker_line_on_every_node(tmp_path):
    # Node 1 lacks the NIC it is told to use, runs another torch and, being
    # "another host", makes node 0's loopback address undialable.
    odd = {"HETPIPE_DOCTOR_FAKE_TORCH": "2.10.0", "HETPIPE_DOCTOR_FAKE_HOST": "other"}
    nodes = run_nodes([JOB, [*JOB, "cluster.transport.interfaces=[nosuch0]"]], [{}, odd], tmp_path)
    import torch

    for proc in nodes:
        assert proc.returncode != 0, proc.stdout
        found = blockers(proc.stdout)
        assert len(found) == 3, proc.stdout
        assert found[0] == ("node 0 (nvidia): cluster.transport.addresses gives 127.0.0.1, a loopback address that "
                            "other nodes cannot reach: select NICs with cluster.transport.interfaces=[NAME,...] or "
                            "cluster.transport.subnets=[CIDR,...]")
        assert found[1].startswith("node 1 (amd): cluster.transport.interfaces names interface nosuch0 that this "
                                   "node lacks (it has lo 127.0.0.1")
        assert found[2] == ("node 1 (amd) runs torch 2.10.0 (CPU build), outside the releases hetpipe supports "
                            "(2.11 to 2.15): install one of them on this node")
        assert (f"hetpipe doctor: node 0 (nvidia): torch {torch.__version__} (CPU build): supported; nodes may run "
                "different supported releases") in proc.stdout
        assert ("hetpipe doctor: node 1 (amd): torch 2.10.0 (CPU build): not supported (hetpipe supports 2.11 to "
                "2.15)") in proc.stdout
        assert proc.stdout.rstrip().endswith("hetpipe doctor: 3 blockers")


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair named hpd0 on both ends
    (10.201.0.1 and .2/24): two hosts as far as the network stack goes."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    names = [f"hpdoc-{os.getpid()}-{k}" for k in range(2)]
    made = []
    try:
        for ns in names:
            if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
                pytest.skip("cannot create a network namespace here")
            made.append(ns)
        subprocess.run(["ip", "link", "add", "hpd0", "netns", names[0], "type", "veth", "peer", "name", "hpd0",
                        "netns", names[1]], check=True, capture_output=True)
        for k, ns in enumerate(names):
            for cmd in (["addr", "add", f"10.201.0.{k + 1}/24", "dev", "hpd0"], ["link", "set", "hpd0", "up"],
                        ["link", "set", "lo", "up"]):
                subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        yield names
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_nodes_in_separate_network_stacks_pass_over_their_nic(tmp_path, two_namespaces):
    # The namespaces share the host's name, which resolves to loopback in
    # each: torchrun must be told each node's address and who hosts the store.
    prefixes = [["ip", "netns", "exec", ns] for ns in two_namespaces]
    launcher = [["--local-addr", "10.201.0.1", "--rdzv-conf", "is_host=1"], ["--local-addr", "10.201.0.2"]]
    over_nic = [*JOB, "cluster.transport.interfaces=[hpd0]"]
    nodes = run_nodes([over_nic, over_nic], [{}, {}], tmp_path, "10.201.0.1", prefixes, launcher)
    for proc in nodes:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "node 0 hpd0 10.201.0.1  node 1 hpd0 10.201.0.2:" in proc.stdout
        # Two network stacks (the "net" column): loopback would count as undialable here.
        rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("  0 (nvidia)", "  1 (amd)"))]
        assert len({row[3] for row in rows}) == 2
        assert proc.stdout.rstrip().endswith("hetpipe doctor: ok: a job can start")
