"""The launch environment each node derives from Slurm, Kubernetes or the
user's variables, the launcher script, and the scheduler templates.

No real Slurm or Kubernetes runs here: the tests set the variables those
schedulers document, parse the templates, and start the launcher as two
"nodes" on this machine.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli_zygote import python_shim
from conftest import USUAL_ENV
from hetpipe.errors import ConfigError
from hetpipe.launch.scheduler_env import (check_job_token, cluster_choice, derive, expand_hostlist, load_cluster,
                                   read_token_file)

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "launch_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "hetpipe_hetjob.sbatch"
MANIFEST = REPO / "scripts" / "k8s" / "hetpipe.yaml"
# A job secret as hetpipe requires (32+ random hex digits); a fixed one keeps runs alike.
TOKEN = "9c41e07b5fd2a8363e0b94c7d1f5a2e86b3d0c9f7a4e1b58"

# Two H200 nodes of 8 ranks, then three MI325X nodes of 4: uneven on purpose.
BIG = load_cluster("h200_mi325x_2node", [("groups.0.nodes", "2"), ("groups.1.nodes", "3"),
                                         ("groups.1.ranks_per_node", "4")])
NVIDIA_NODES = ["h200-07", "h200-08"]
AMD_NODES = ["mi325x-a01", "mi325x-a02", "mi325x-b10"]
SLURM_HETJOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_ID_HET_GROUP_0": "4242",
    "SLURM_JOB_ID_HET_GROUP_1": "4243",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "h200-[07-08]",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "mi325x-a[01-02],mi325x-b10",
}


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's or launcher's variables."""
    drop = ("SLURM_", "KUBERNETES_", "HETPIPE_", "RDZV_", "MASTER_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("NODE_RANK", "NNODES", "NPROC_PER_NODE")}
    return {**env, **extra}


def _slurm_task(node: str, **extra: str) -> dict[str, str]:
    """What a task of ``srun --het-group=K`` on ``node`` sees."""
    return {**SLURM_HETJOB, "SLURMD_NODENAME": node, "SLURM_NODEID": "0", **extra}


# --- Slurm host lists -------------------------------------------------------------------------

@pytest.mark.parametrize("spec,hosts", [
    ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
    ("login1,gpu[8-10]", ["login1", "gpu8", "gpu9", "gpu10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("h200-07", ["h200-07"]),
])
def test_slurm_host_lists_expand_without_scontrol(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu-[01-03", "gpu-[3-1]", "gpu-[a-b]", "gpu-[]", "a,,b"])
def test_bad_host_lists_are_refused(spec):
    with pytest.raises(ConfigError, match=re.escape(repr(spec))):
        expand_hostlist(spec)


# --- Slurm heterogeneous job ------------------------------------------------------------------

def test_slurm_hetjob_places_every_node_in_the_cluster_config_order():
    launches = [derive(_slurm_task(node, SLURM_GPUS_ON_NODE="8"), BIG) for node in NVIDIA_NODES + AMD_NODES]
    assert [n.node_rank for n in launches] == [0, 1, 2, 3, 4]
    assert [n.group for n in launches] == ["nvidia"] * 2 + ["amd"] * 3
    assert [n.vendor for n in launches] == ["nvidia"] * 2 + ["amd"] * 3
    assert [n.nproc_per_node for n in launches] == [8, 8, 4, 4, 4]
    assert [n.first_rank for n in launches] == [0, 8, 16, 20, 24]
    assert {n.scheduler for n in launches} == {"slurm"}
    assert {n.nnodes for n in launches} == {5}
    # Node 0 = component 0's first node hosts the rendezvous; the id is the job's.
    assert {n.rdzv_endpoint for n in launches} == {"h200-07:29400"}
    assert {n.rdzv_id for n in launches} == {"4242"}
    assert [n.rdzv_is_host for n in launches] == [True, False, False, False, False]
    # The nodes' ranks tile the world exactly once.
    ranks = sorted(r for n in launches for r in range(n.first_rank, n.first_rank + n.nproc_per_node))
    assert ranks == list(range(BIG.world_size))


def test_slurm_exports_are_shell_quoted_lines():
    launch = derive(_slurm_task("mi325x-b10", HETPIPE_RDZV_PORT="29555"), BIG)
    lines = launch.shell().splitlines()
    assert "export HETPIPE_NODE_RANK=4" in lines
    assert "export HETPIPE_FIRST_RANK=24" in lines
    assert "export HETPIPE_NPROC_PER_NODE=4" in lines
    assert "export HETPIPE_RDZV_ENDPOINT=h200-07:29555" in lines
    assert "export HETPIPE_RDZV_IS_HOST=0" in lines
    assert all(line.startswith("export HETPIPE_") for line in lines)


def test_plain_slurm_job_fits_a_one_group_cluster_or_one_machine():
    homogeneous = load_cluster("gpu8_homogeneous", [("groups.0.nodes", "3")])
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURMD_NODENAME": "gpu2"}
    launch = derive(env, homogeneous)
    assert (launch.node_rank, launch.nnodes, launch.first_rank, launch.rdzv_endpoint) == (1, 3, 8, "gpu1:29400")
    one_machine = derive({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu1", "SLURMD_NODENAME": "gpu1"},
                         load_cluster("cpu_mixed"))
    assert (one_machine.nnodes, one_machine.nproc_per_node, one_machine.rdzv_is_host) == (1, 2, True)


@pytest.mark.parametrize("change,needle", [
    ({"SLURM_HET_SIZE": "3"}, "SLURM_HET_SIZE=3"),
    ({"SLURM_JOB_NODELIST_HET_GROUP_1": "mi325x-a[01-02]"}, "SLURM_JOB_NODELIST_HET_GROUP_1 has 2 nodes"),
    ({"SLURM_JOB_NODELIST_HET_GROUP_1": ""}, "SLURM_JOB_NODELIST_HET_GROUP_1 is not set"),
    ({"SLURM_JOB_NODELIST_HET_GROUP_0": "h200-[07-08"}, "SLURM_JOB_NODELIST_HET_GROUP_0:"),
    ({"SLURMD_NODENAME": "login1"}, "SLURMD_NODENAME=login1"),
    ({"SLURMD_NODENAME": ""}, "SLURMD_NODENAME is not set"),
    ({"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ({"NPROC_PER_NODE": "4"}, "NPROC_PER_NODE=4"),
    ({"SLURM_HET_SIZE": "two"}, "SLURM_HET_SIZE='two'"),
])
def test_inconsistent_slurm_variables_name_the_variable(change, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        derive({**_slurm_task("h200-08"), **change}, BIG, "slurm")


def test_a_mixed_cluster_needs_a_heterogeneous_job():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"}
    with pytest.raises(ConfigError, match="SLURM_HET_SIZE is not set.*heterogeneous job"):
        derive(env, load_cluster("h200_mi325x_2node"))


# --- Kubernetes -------------------------------------------------------------------------------

def _pod(group: str, index: int, **extra: str) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HETPIPE_GROUP": group, "JOB_COMPLETION_INDEX": str(index),
            "RDZV_ENDPOINT": "hetpipe-nvidia-0.hetpipe-rdzv:29400", "RDZV_ID": "run1", **extra}


def test_k8s_pods_get_node_ranks_from_their_group_and_index():
    pods = [("nvidia", 0), ("nvidia", 1), ("amd", 0), ("amd", 1), ("amd", 2)]
    launches = [derive(_pod(group, index), BIG) for group, index in pods]
    assert [n.node_rank for n in launches] == [0, 1, 2, 3, 4]
    assert [n.first_rank for n in launches] == [0, 8, 16, 20, 24]
    assert [n.rdzv_is_host for n in launches] == [True, False, False, False, False]
    assert {(n.scheduler, n.rdzv_endpoint, n.rdzv_id) for n in launches} == {
        ("k8s", "hetpipe-nvidia-0.hetpipe-rdzv:29400", "run1")}


def test_k8s_statefulset_ordinal_comes_from_the_hostname():
    env = _pod("amd", 0, HOSTNAME="hetpipe-amd-2")
    del env["JOB_COMPLETION_INDEX"]
    assert derive(env, BIG).node_rank == 4


@pytest.mark.parametrize("change,needle", [
    ({"HETPIPE_GROUP": "intel"}, "HETPIPE_GROUP='intel'"),
    ({"JOB_COMPLETION_INDEX": "3"}, "JOB_COMPLETION_INDEX gives pod index 3"),
    ({"JOB_COMPLETION_INDEX": "", "HOSTNAME": "trainer"}, "JOB_COMPLETION_INDEX is not set"),
    ({"RDZV_ENDPOINT": ""}, "RDZV_ENDPOINT is not set"),
    ({"RDZV_ENDPOINT": "svc:99999"}, "RDZV_ENDPOINT='svc:99999'"),
])
def test_bad_k8s_pod_variables_name_the_variable(change, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        derive({**_pod("amd", 1), **change}, BIG)


# --- plain variables --------------------------------------------------------------------------

def test_plain_variables_and_the_one_machine_default():
    cluster = load_cluster("h200_mi325x_2node")
    launch = derive({"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, cluster)
    assert (launch.scheduler, launch.nnodes, launch.node_rank, launch.first_rank, launch.group) == \
        ("env", 2, 1, 8, "amd")
    assert (launch.rdzv_endpoint, launch.rdzv_is_host) == ("10.0.0.1:29500", False)
    assert derive({"NODE_RANK": "0", "RDZV_ENDPOINT": "[fd00::1]"}, cluster).rdzv_endpoint == "[fd00::1]:29400"
    alone = derive({}, load_cluster("cpu_mixed"))
    assert (alone.nnodes, alone.nproc_per_node, alone.group, alone.rdzv_endpoint) == \
        (1, 2, "nvidia,amd", "127.0.0.1:0")
    # The user's NODE_RANK wins over a surrounding scheduler's variables.
    assert derive({"NODE_RANK": "0", "RDZV_ENDPOINT": "a", "SLURM_JOB_ID": "1"}, cluster).scheduler == "env"


@pytest.mark.parametrize("env,needle", [
    ({"NODE_RANK": "1"}, "RDZV_ENDPOINT is not set"),
    ({"NODE_RANK": "2", "RDZV_ENDPOINT": "a"}, "NODE_RANK=2"),
    ({"NODE_RANK": "-1", "RDZV_ENDPOINT": "a"}, "NODE_RANK=-1"),
    ({"NNODES": "3", "NODE_RANK": "0", "RDZV_ENDPOINT": "a"}, "NNODES=3"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "a"}, "NODE_RANK is not set"),
    ({"NNODES": "1", "NODE_RANK": "1"}, "NODE_RANK=1 but NNODES=1"),
])
def test_bad_plain_variables_name_the_variable(env, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        derive(env, load_cluster("h200_mi325x_2node"))


def test_cluster_and_its_overrides_come_from_pretrains_arguments():
    assert cluster_choice(None, ["+model=llama8b", "cluster=cpu_mixed", "cluster.groups.1.nodes=2",
                                 "train.seq_length=64"]) == ("cpu_mixed", [("groups.1.nodes", "2")])
    assert cluster_choice(None, ["+model=llama8b"])[0] == "single"  # pretrain's default
    with pytest.raises(ConfigError, match="no cluster config 'nope'.*cpu_mixed"):
        load_cluster("nope")
    with pytest.raises(ConfigError, match="nodez"):
        load_cluster("cpu_mixed", [("groups.0.nodez", "2")])


# --- the job token ----------------------------------------------------------------------------

def test_token_file_must_be_its_owners_only(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    assert read_token_file(str(path)) == TOKEN
    check_job_token({"HETPIPE_JOB_TOKEN_FILE": str(path)}, nnodes=2)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"open to group or others \(mode 0644\): chmod 600"):
        read_token_file(str(path))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="mode 0640"):
        check_job_token({"HETPIPE_JOB_TOKEN_FILE": str(path)}, nnodes=2)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o400)
    with pytest.raises(ConfigError, match="is empty"):
        read_token_file(str(empty))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_token_file(str(tmp_path / "missing"))


def test_multi_node_needs_a_token_but_one_machine_does_not():
    with pytest.raises(ConfigError, match="HETPIPE_JOB_TOKEN is not set: a job on 2 nodes"):
        check_job_token({}, nnodes=2)
    check_job_token({}, nnodes=1)
    check_job_token({"HETPIPE_JOB_TOKEN": TOKEN}, nnodes=5)


# --- the CLI and the launcher -----------------------------------------------------------------

def test_cli_prints_exports_that_a_shell_evals():
    env = _clean_env(**_slurm_task("mi325x-a02"), HETPIPE_JOB_TOKEN=TOKEN, PYTHON=python_shim(USUAL_ENV))
    script = ('eval "$("$PYTHON" -m hetpipe.launch.scheduler_env -- +model=llama8b cluster=h200_mi325x_2node '
              'cluster.groups.0.nodes=2 cluster.groups.1.nodes=3 cluster.groups.1.ranks_per_node=4 '
              # this host has none of the shipped config's subnets; lo stands in
              'cluster.transport.subnets=null cluster.transport.interfaces=[lo])"; '
              'echo "$HETPIPE_NODE_RANK $HETPIPE_FIRST_RANK $HETPIPE_GROUP $HETPIPE_RDZV_ENDPOINT"')
    proc = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "20", "amd", "h200-07:29400"]
    assert proc.stderr.startswith("hetpipe: node 3 of 5 (slurm): group amd")


def test_cli_bad_variable_is_one_line_and_exit_2():
    env = _clean_env(**_slurm_task("h200-07", SLURM_HET_SIZE="3"), HETPIPE_JOB_TOKEN=TOKEN)
    proc = subprocess.run([sys.executable, "-m", "hetpipe.launch.scheduler_env", "--cluster", "h200_mi325x_2node"],
                          env=env, cwd=REPO, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "hetpipe: error: SLURM_HET_SIZE=3 but cluster 'h200_mi325x_2node' has 2 groups, one job component each"]


def test_launcher_refuses_a_token_file_others_can_read(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    env = _clean_env(NODE_RANK="1", RDZV_ENDPOINT="127.0.0.1:29400", HETPIPE_JOB_TOKEN_FILE=str(token),
                     PYTHON=python_shim(USUAL_ENV))
    proc = subprocess.run(["bash", str(LAUNCHER), "+model=tiny_llama", "cluster=cpu_mixed"], env=env, cwd=REPO,
                          text=True, capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hetpipe: error: HETPIPE_JOB_TOKEN_FILE={token} is open to group or others (mode 0644): chmod 600 it"]


def test_launcher_script_parses_and_uses_c10d_rendezvous():
    assert subprocess.run(["bash", "-n", str(LAUNCHER)]).returncode == 0
    text = LAUNCHER.read_text()
    assert "--rdzv-backend c10d --rdzv-endpoint" in text and "--rdzv-id" in text
    assert "--master-addr" not in text
    # Restarts are torchrun's, with the count train.max_restarts must equal.
    assert '--max-restarts "$HETPIPE_MAX_RESTARTS"' in text


TWO_NODE_ARGS = ["+model=tiny_llama", "cluster=cpu_mixed", "train.train_iters=2", "train.global_batch_size=8",
                 "train.seq_length=64"]


def _two_nodes(tmp_path: Path, **extra: str) -> tuple[str, str]:
    """launch_cluster.sh as two "nodes" of cpu_mixed on this machine, node 1
    started first; both must succeed. Returns their outputs (node 0, node 1)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _clean_env(PYTHON=python_shim(USUAL_ENV), HETPIPE_JOB_TOKEN=TOKEN, RDZV_ENDPOINT=f"127.0.0.1:{port}", **extra)
    node1 = subprocess.Popen(["bash", str(LAUNCHER), *TWO_NODE_ARGS, f"hydra.run.dir={tmp_path / 'node1'}"],
                             env={**env, "NODE_RANK": "1"}, cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    node0 = subprocess.run(["bash", str(LAUNCHER), *TWO_NODE_ARGS, f"hydra.run.dir={tmp_path / 'node0'}"],
                           env={**env, "NODE_RANK": "0"}, cwd=REPO, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=240)
    out1 = node1.communicate(timeout=120)[0]
    assert node0.returncode == 0 and node1.returncode == 0, node0.stdout[-3000:] + out1[-3000:]
    return node0.stdout, out1


def test_two_nodes_on_this_machine_train_like_one(tmp_path):
    """Node 1 starts first, so torchrun's c10d rendezvous (which orders nodes
    by host and pid) makes it its rank 0; the launcher still runs hetpipe's
    rank 0 - the nvidia group, which writes the metrics - on node 0."""
    out0, out1 = _two_nodes(tmp_path, HETPIPE_DOCTOR="0")
    assert "node 0 of 2 (env): group nvidia (nvidia), ranks 0-0" in out0
    assert "node 1 of 2 (env): group amd (amd), ranks 1-1" in out1
    assert (tmp_path / "node0" / "metrics.jsonl").is_file()
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()
    alone = subprocess.run(["bash", str(LAUNCHER), *TWO_NODE_ARGS, f"hydra.run.dir={tmp_path / 'alone'}"],
                           env=_clean_env(PYTHON=python_shim(USUAL_ENV)), cwd=REPO, text=True, capture_output=True,
                           timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    losses = {run: [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("node0", "alone")}
    assert len(losses["alone"]) == 2 and losses["node0"] == losses["alone"]


def test_the_doctor_checks_every_node_before_the_job(tmp_path):
    pytest.importorskip("hetpipe.doctor")
    out0, out1 = _two_nodes(tmp_path, HETPIPE_DOCTOR="1")
    for out in (out0, out1):
        assert "hetpipe doctor: 2 nodes reported" in out and "hetpipe doctor: ok: a job can start" in out
    # On node 0, which logs the training steps, the check comes first.
    assert out0.index("hetpipe doctor: ok") < out0.index("step      2/2")


# --- the scheduler templates (not run on a real scheduler) ------------------------------------

def test_sbatch_is_a_heterogeneous_job_with_one_step_per_component():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    lines = SBATCH.read_text().splitlines()
    # sbatch reads directives only up to the first command.
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line.split(None, 1)[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    split = directives.index("hetjob")
    components = [directives[:split], directives[split + 1:]]
    assert [[d for d in c if d.startswith("--partition=")] for c in components] == [
        ["--partition=h200"], ["--partition=mi325x"]]
    for component in components:
        assert "--ntasks-per-node=1" in component and "--gpus-per-node=8" in component
    body = "\n".join(lines[first_command:])
    assert 'srun --het-group="$component"' in body and "scripts/launch_cluster.sh" in body
    assert "HETPIPE_JOB_TOKEN_FILE" in body and "umask 077" in body


def test_k8s_manifest_names_both_vendors_and_a_headless_service():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    service = next(d for d in docs if d["kind"] == "Service")
    secret = next(d for d in docs if d["kind"] == "Secret")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    pods = [job["spec"]["template"] for job in jobs]
    containers = [pod["spec"]["containers"][0] for pod in pods]
    assert [c["resources"]["limits"] for c in containers] == [{"nvidia.com/gpu": 8}, {"amd.com/gpu": 8}]
    # The same command in both pod groups; only the group differs.
    assert len({(tuple(c["command"]), tuple(c["args"])) for c in containers}) == 1
    assert containers[0]["command"] == ["bash", "scripts/launch_cluster.sh"]
    for job, pod in zip(jobs, pods):
        assert job["spec"]["completionMode"] == "Indexed"
        assert pod["spec"]["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
        assert volume["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o400}
    assert secret["stringData"]["token"] == ""  # filled in at apply time, never committed
    # Each pod's launch, derived from the variables the manifest sets.
    cluster_arg = next(a for a in containers[0]["args"] if a.startswith("cluster="))
    cluster = load_cluster(cluster_arg.split("=", 1)[1])
    launches = []
    for job, container in zip(jobs, containers):
        env = {e["name"]: e["value"] for e in container["env"]}
        for index in range(job["spec"]["completions"]):
            launches.append(derive({**env, "JOB_COMPLETION_INDEX": str(index)}, cluster, env["HETPIPE_SCHEDULER"]))
    assert [(n.node_rank, n.group, n.nproc_per_node) for n in launches] == [(0, "nvidia", 8), (1, "amd", 8)]
    host, port = launches[0].rdzv_endpoint.split(":")
    assert host == f"{jobs[0]['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"]
