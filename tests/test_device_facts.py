"""The real device, always: every rank's device in the roll call, and the start-up check that
the plan was made for it (hetpipe/devices/facts.py)."""
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from conftest import REPO, run_cli
from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.devices.facts import (DeviceFacts, check_devices, check_local_devices, device_facts, devices_lines,
                                  host_memory_gib)
from hetpipe.errors import ConfigError
from hetpipe.models import model_preset
from hetpipe.launch.nodes import NodeMap, roll_call
from hetpipe.partitioner.plan_data import Plan, StagePlan
from hetpipe.partitioner.solver import plan_for
from hetpipe.schema.pretrain_config import TrainConfig

H100 = DeviceFacts("NVIDIA H100 80GB HBM3", "nvidia", "CUDA 13.0", "2.11.0+cu130", "sm_90", 79.19, 78.5, "H100")
CPU = DeviceFacts("cpu", "cpu", "cpu", torch.__version__, "x86_64", 64.0, 40.0, "CPU")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")


def _cluster(*types: str, ranks: int = 1, allow: bool = False) -> ClusterConfig:
    names = ["nvidia", "amd"]
    return ClusterConfig(name="t", emulate=True, allow_device_mismatch=allow, groups=[
        GroupConfig(name=names[i], vendor=names[i], device_type=t, ranks_per_node=ranks)
        for i, t in enumerate(types)])


def test_a_cpu_rank_reports_its_device():
    facts = device_facts(torch.device("cpu"))
    assert (facts.name, facts.vendor, facts.runtime, facts.device_type) == ("cpu", "cpu", "cpu", "CPU")
    assert facts.torch == torch.__version__ and facts.arch
    assert facts.total_gib > 0 and 0 <= facts.free_gib <= facts.total_gib
    assert host_memory_gib()[0] == pytest.approx(facts.total_gib)
    assert DeviceFacts.from_dict(facts.to_dict()) == facts  # what the roll call carries


def test_a_declared_type_that_is_not_the_device_is_one_line_naming_both():
    with pytest.raises(ConfigError) as caught:
        check_devices(_cluster("H200", ranks=2), {0: H100, 1: H100})
    assert str(caught.value) == (
        "group 'nvidia' declares device_type H200 but rank 0 runs on 'NVIDIA H100 80GB HBM3' (H100): set "
        "cluster.groups.0.device_type=auto (or H100), or cluster.allow_device_mismatch=true to plan for H200 "
        "on purpose")
    assert check_devices(_cluster("h100", ranks=2), {0: H100, 1: H100}) == []  # case-insensitive
    assert check_devices(_cluster("auto", ranks=2), {0: H100, 1: H100}) == []  # auto: whatever it is
    assert check_devices(_cluster("CPU", "CPU"), {0: CPU, 1: CPU}) == []  # an emulated CPU cluster
    # The second group's rank is named, not the first's.
    with pytest.raises(ConfigError, match=r"group 'amd' declares device_type MI325X but rank 1 runs on 'NVIDIA"):
        check_devices(_cluster("H100", "MI325X"), {0: H100, 1: H100})


def test_the_override_plans_for_the_declared_type_with_a_warning():
    warnings = check_devices(_cluster("H200", allow=True), {0: H100})
    assert warnings == ["group 'nvidia' declares device_type H200 but rank 0 runs on 'NVIDIA H100 80GB HBM3' "
                        "(H100): going on for H200, as cluster.allow_device_mismatch=true asks"]
    # A GPU type cannot run on a CPU, override or not.
    with pytest.raises(ConfigError, match=r"declares device_type H100 but rank 0 runs on 'cpu' \(CPU\): set "
                                          r"cluster.groups.0.device_type=auto \(or CPU\), or run it where"):
        check_devices(_cluster("H100", allow=True), {0: CPU})


def test_a_device_the_catalog_does_not_know_is_taken_as_declared():
    unknown = DeviceFacts("Some Accelerator", "nvidia", "CUDA 13.0", "2.11", "sm_120", 90.0, 80.0, "")
    assert check_devices(_cluster("H200"), {0: unknown}) == []
    assert "not in the catalog" in devices_lines(_cluster("H200"), {0: unknown})[0]


def test_an_auto_group_is_checked_against_the_type_its_plan_was_made_for():
    plan = Plan([StagePlan("nvidia", [0], 2)], notes={"device_types": {"nvidia": "H200"}})
    with pytest.raises(ConfigError, match=r"the plan was made for group 'nvidia' on H200 .* but rank 0 runs on "
                                          r"'NVIDIA H100 80GB HBM3' \(H100\): make the plan on this hardware"):
        check_devices(_cluster("auto"), {0: H100}, plan)
    assert check_devices(_cluster("auto"), {0: H100}, Plan([StagePlan("nvidia", [0], 2)])) == []


@no_gpu
def test_plan_auto_records_the_device_types_it_planned_for():
    cluster = ClusterConfig(groups=[GroupConfig(name="local", device_type="auto")])
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, seq_length=64)
    plan = plan_for(model_preset("tiny_llama"), cluster, train)
    assert plan.notes["device_types"] == {"local": "CPU"}
    assert check_devices(cluster, {0: device_facts(torch.device("cpu"))}, plan) == []


def test_the_devices_line_is_one_per_group():
    lines = devices_lines(_cluster("auto", "CPU", ranks=2), {0: H100, 1: H100, 2: CPU, 3: CPU})
    assert lines == [
        "hetpipe: devices: nvidia group: 2 x NVIDIA H100 80GB HBM3 (H100, CUDA 13.0, torch 2.11.0+cu130), "
        "79.2 GiB each, 78.5 free",
        f"hetpipe: devices: amd group: 2 x cpu (CPU, torch {torch.__version__}), 64.0 GiB of host memory, "
        "40.0 free"]


def test_the_roll_call_brings_every_ranks_device():
    store = dist.HashStore()
    cluster = _cluster("CPU", "H100")
    layout = NodeMap.layout(cluster, multi_node=False)
    maps = {}

    def answer(rank, device):
        maps[rank] = roll_call(store, rank, layout, ["127.0.0.1"], 10.0, lambda: None, device)

    other = threading.Thread(target=answer, args=(1, H100))
    other.start()
    answer(0, CPU)
    other.join()
    assert maps[0].devices == maps[1].devices == {0: CPU, 1: H100}


def test_gpu_configs_take_the_gpus_they_find():
    for path in sorted((REPO / "configs" / "cluster").glob("gpu*.yaml")):
        types = {g["device_type"] for g in yaml.safe_load(path.read_text())["groups"]}
        assert types == {"auto"}, path.name
    # The two real clusters describe their hardware, which the check then verifies.
    for name, types in (("h200_mi325x_2node", ["H200", "MI325X"]), ("a100_40gb_mi300x_2node", ["A100-40GB", "MI300X"])):
        groups = yaml.safe_load((REPO / "configs" / "cluster" / f"{name}.yaml").read_text())["groups"]
        assert [g["device_type"] for g in groups] == types


@no_gpu
def test_the_launcher_checks_before_starting_any_rank():
    with pytest.raises(ConfigError, match=r"group 'amd' declares device_type H100 but rank 1 runs on 'cpu'"):
        check_local_devices(_cluster("CPU", "H100"))
    check_local_devices(_cluster("CPU", "CPU"))


def test_a_gpu_group_that_finds_no_gpu_stops_unless_the_cpu_is_asked_for():
    with pytest.raises(ConfigError) as caught:
        check_devices(_cluster("CPU", "auto"), {0: CPU, 1: CPU})
    assert str(caught.value) == (
        f"cluster 't' group 'amd' runs on amd GPUs but rank 1 finds none (torch {torch.__version__} sees no GPU): "
        "run it where the GPUs are, or set cluster.allow_cpu=true to run it on the CPU on purpose "
        "(cluster=cpu_mixed is the emulated CPU cluster)")
    asked = _cluster("auto", "auto")
    asked.allow_cpu = True
    assert check_devices(asked, {0: CPU, 1: CPU}) == []
    assert check_devices(_cluster("auto", "auto"), {0: H100, 1: H100}) == []
    # A group of vendor auto (cluster=single) takes whatever it finds, the CPU too.
    assert check_devices(ClusterConfig(groups=[GroupConfig(name="local")]), {0: CPU}) == []


@no_gpu
def test_a_gpu_cluster_without_gpus_is_one_line_and_exit_2_before_any_rank(tmp_path):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", "cluster=gpu2_mixed", "train.train_iters=1",
                    f"hydra.run.dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"hetpipe: error: cluster 'gpu2_mixed' group 'nvidia' runs on nvidia GPUs but rank 0 finds none (torch "
        f"{torch.__version__} sees no GPU): run it where the GPUs are, or set cluster.allow_cpu=true to run it on "
        "the CPU on purpose (cluster=cpu_mixed is the emulated CPU cluster)"]
    assert not (tmp_path / "metrics.jsonl").exists() and "hetpipe: devices:" not in proc.stdout


@no_gpu
def test_a_gpu_type_on_a_cpu_cluster_is_one_line_and_exit_2(tmp_path):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", "cluster=cpu_mixed",
                    "cluster.groups.1.device_type=H100", "train.train_iters=1", f"hydra.run.dir={tmp_path}"],
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        "hetpipe: error: group 'amd' declares device_type H100 but rank 1 runs on 'cpu' (CPU): set "
        "cluster.groups.1.device_type=auto (or CPU), or run it where the GPUs are"]


@no_gpu
def test_ranks_say_their_devices_and_stop_together_on_a_plan_for_other_devices(tmp_path):
    """rank 0's lines name both groups' devices, the other's from the roll call; a plan
    made for H200 stops every rank with the same line (the launcher cannot see a plan's
    notes before it starts the ranks) and exit 2."""
    common = ["-m", "hetpipe.pretrain", "+model=tiny_llama", "cluster=cpu_mixed", "train.train_iters=1",
              "cluster.groups.0.device_type=auto", "cluster.groups.1.device_type=auto", "cluster.allow_cpu=true"]
    ran = run_cli([*common, f"hydra.run.dir={tmp_path / 'ok'}"], timeout=180)
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stdout.splitlines() if line.startswith("hetpipe: devices: ")]
    assert [line.split(":")[2].strip() for line in lines] == ["nvidia group", "amd group"], ran.stdout
    assert all(" x cpu (CPU, torch " in line for line in lines)
    plan = yaml.safe_load((tmp_path / "ok" / "plan.yaml").read_text())
    plan["notes"] = {"device_types": {"nvidia": "H200", "amd": "CPU"}}
    path = Path(tmp_path / "h200.yaml")
    path.write_text(yaml.safe_dump(plan))
    stopped = run_cli([*common, f"plan={path}", f"hydra.run.dir={tmp_path / 'stop'}"], timeout=180)
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr, stopped.stderr
    errors = [line.split("] ", 1)[1] for line in stopped.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert len(errors) == 1, stopped.stderr  # one line for the job, though both ranks stop with it
    assert errors[0].startswith("the plan was made for group 'nvidia' on H200 (its notes.device_types) but rank 0 "
                                "runs on 'cpu' (CPU)"), errors[0]
