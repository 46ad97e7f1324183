"""The loss-curve comparison CLI and the partition plan as data."""
import json

import pytest

from conftest import run_cli
from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.schema.pretrain_config import PartitionConfig
from hetpipe.errors import ConfigError
from hetpipe.models import model_preset
from hetpipe.partitioner.plan_data import Plan, even_split
from hetpipe.partitioner.resolve import build_plan


def _run(tmp_path, name, losses):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                             for i, x in enumerate(losses)))
    return str(d)


def test_compare_verdicts_and_exit_codes(tmp_path):
    a = _run(tmp_path, "a", [5.0, 4.0, 3.0])
    same = _run(tmp_path, "same", [5.0, 4.0, 3.0])
    close = _run(tmp_path, "close", [5.0, 4.0, 3.0 * (1 + 1e-7)])
    proc = run_cli(["-m", "hetpipe.compare", a, same, "--rtol", "0"])
    assert proc.returncode == 0 and "bitwise identical" in proc.stdout
    proc = run_cli(["-m", "hetpipe.compare", a, close, "--rtol", "0"])
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    proc = run_cli(["-m", "hetpipe.compare", a, close, "--rtol", "1e-5"])
    assert proc.returncode == 0 and "PASS" in proc.stdout
    proc = run_cli(["-m", "hetpipe.compare", a, str(tmp_path / "missing")])
    assert proc.returncode == 2 and "hetpipe: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_yaml_round_trip_and_unit_ranges(tmp_path):
    cluster = ClusterConfig(name="c", emulate=True, groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="CPU", ranks_per_node=2),
        GroupConfig(name="amd", vendor="amd", device_type="CPU", ranks_per_node=2)])
    model = model_preset("tiny_llama", num_layers=8)
    plan = build_plan(PartitionConfig(layers=[1, 3, 2, 2]), cluster, model)
    assert [s.group for s in plan.stages] == ["nvidia", "nvidia", "amd", "amd"]
    # Embedding joins stage 0, the head the last stage: 10 units in all.
    assert plan.unit_ranges() == [(0, 2), (2, 5), (5, 7), (7, 10)]
    plan.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == plan
    with pytest.raises(ConfigError, match="plan splits 7 layers"):
        build_plan(PartitionConfig(layers=[1, 2, 2, 2]), cluster, model)
    with pytest.raises(ConfigError, match="has 2 entries but cluster .one. gives 1 pipeline stage"):
        build_plan(PartitionConfig(layers=[4, 4]), ClusterConfig(name="one"), model)


def test_even_split_prefers_middle_stages():
    assert even_split(32, 2) == [16, 16]
    assert even_split(8, 3) == [2, 3, 3] or even_split(8, 3) == [3, 3, 2]
    assert sum(even_split(30, 4)) == 30 and even_split(30, 4)[1:3] == [8, 8]
