"""Errors that point the way, on both hydra entry points: the closest name for a
misspelt key or preset, the fix for a group added without its +, Megatron-LM's
and torchtitan's flags answered with hetpipe's overrides (one table, the same
in docs/coming_from_megatron.md), and --help with each field's description."""
import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from conftest import REPO, run_cli
from hetpipe.schema.field_docs import field_docs
from hetpipe.errors.foreign_flags import FLAGS, VALUE, foreign_flags_line, markdown_table
from hetpipe.models.model_config import ModelConfig
from hetpipe.plan import PlanConfig
from hetpipe.schema.pretrain_config import PretrainConfig

E = "hetpipe: error: "
GUIDE = "(docs/coming_from_megatron.md)"


@pytest.mark.parametrize("module, args, line", [
    ("pretrain", ["+model=tiny_llama", "train.train_iter=10"],
     "bad command line: Could not override 'train.train_iter': Key 'train_iter' not in 'TrainConfig' "
     "(did you mean train.train_iters?)"),
    ("pretrain", ["model=llama8b"],
     "bad command line: model=llama8b: model has no default to override; add it with a +: +model=llama8b"),
    ("pretrain", ["+model=tiny_llama", "cluster=cpu_mix"],
     "bad command line: In 'pretrain': Could not find 'cluster/cpu_mix' (did you mean cluster=cpu_mixed?) "
     "(available: a100_40gb_mi300x_2node, cpu_2node, cpu_homogeneous, cpu_mixed, gpu2_homogeneous, gpu2_mixed, "
     "gpu4_homogeneous, gpu4_mixed, gpu8_homogeneous, gpu8_mixed, h200_mi325x_2node, single)"),
    ("pretrain", ["--tensor-model-parallel-size=2", "--lr", "1e-3", "--bf16", "+model=tiny_llama"],
     "hetpipe takes hydra overrides, not Megatron-LM flags: --tensor-model-parallel-size 2 is partition.tp=2; "
     f"--lr 1e-3 is optimizer.lr=1e-3; --bf16 is train.precision=bf16 {GUIDE}"),
    ("pretrain", ["--pipline-model-parallel-size", "2"],
     "unknown flag --pipline-model-parallel-size (did you mean --pipeline-model-parallel-size?): hetpipe takes "
     "hydra overrides, key=value (--help lists them; docs/coming_from_megatron.md translates Megatron-LM's and "
     "torchtitan's flags)"),
    ("plan", ["+model=llama8b", "--parallelism.tensor_parallel_degree", "4", "--training.steps", "10"],
     f"hetpipe takes hydra overrides, not torchtitan flags: --parallelism.tensor_parallel_degree 4 is "
     f"partition.tp=4; --training.steps 10 is train.train_iters=10 {GUIDE}"),
    ("plan", ["+model=llama8b", "planner.schedul=zb_v"],
     "bad command line: Could not override 'planner.schedul': Key 'schedul' not in 'PlannerConfig' "
     "(did you mean planner.schedule?)"),
])
def test_errors_name_the_fix_in_one_line_and_exit_2(module, args, line):
    proc = run_cli(["-m", f"hetpipe.{module}", *args, "--cfg", "job"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [E + line], proc.stderr
    assert proc.stdout == ""


def _schema_has(key: str) -> bool:
    """Whether an override's key is a field of pretrain's config (a model field of ModelConfig)."""
    if key.startswith("model."):
        return key.split(".", 1)[1] in {f.name for f in dataclasses.fields(ModelConfig)}
    return OmegaConf.select(OmegaConf.structured(PretrainConfig(model=ModelConfig())), key,
                            default="absent") != "absent"


@pytest.mark.parametrize("argv, line", [
    (["+model=tiny_llama", "--pipeline-model-parallel-size", "2"],
     "hetpipe takes hydra overrides, not Megatron-LM flags: --pipeline-model-parallel-size 2 is "
     "cluster.groups.0.ranks_per_node=2 (pipeline stages = the cluster's ranks / (TP x DP); or a cluster preset, "
     f"or plan=auto) {GUIDE}"),
    (["--context-parallel-size=2", "-m", "train.seed=1,2"],
     f"hetpipe takes hydra overrides, not Megatron-LM flags: --context-parallel-size 2: hetpipe has no context "
     f"parallelism yet {GUIDE}"),
    (["--cfg", "job", "--frob"], "unknown flag --frob: hetpipe takes hydra overrides, key=value (--help lists "
                                 "them; docs/coming_from_megatron.md translates Megatron-LM's and torchtitan's flags)"),
    (["--cfg", "job", "-m", "--info", "config", "+model=tiny_llama", "train.lr=-1"], None),
])
def test_flags_hydra_does_not_take_are_answered(argv, line):
    assert foreign_flags_line(argv) == line


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.flag)
def test_every_translated_flag_names_fields_that_exist(flag):
    line = foreign_flags_line([flag.flag, "7"] if flag.valued else [flag.flag])
    assert line.startswith(f"hetpipe takes hydra overrides, not {flag.source} flags: {flag.flag}")
    assert flag.override.replace(VALUE, "7") in line
    for override in (o for o in flag.override.split() if "=" in o):
        key = override.split("=")[0]
        if key not in ("+model", "data"):  # a preset and a config group, not fields
            assert _schema_has(key), key


def test_the_docs_hold_the_table_the_code_answers_with():
    doc = (REPO / "docs/coming_from_megatron.md").read_text()
    assert markdown_table() in doc, ("docs/coming_from_megatron.md is out of date: paste "
                                     "python -c 'from hetpipe.errors.foreign_flags import markdown_table; "
                                     "print(markdown_table())'")
    assert "docs/coming_from_megatron.md" in (REPO / "README.md").read_text()


def _leaf_fields(cls: type, prefix: str = "") -> list[tuple[type, str, str]]:
    """(dataclass, field, dotted key) of every field that is not itself a config group."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        inner = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        out += _leaf_fields(inner[0], f"{prefix}{f.name}.") if inner else [(cls, f.name, prefix + f.name)]
    return out


@pytest.mark.parametrize("schema", [PretrainConfig, PlanConfig])
def test_every_config_field_has_a_one_line_description(schema):
    missing = [key for cls, name, key in _leaf_fields(schema) if not field_docs(cls)[name]]
    assert missing == [], "write a comment above each of these fields: " + ", ".join(missing)
    assert all("\n" not in field_docs(cls)[name] for cls, name, _ in _leaf_fields(schema))


@pytest.mark.parametrize("module, line", [
    ("pretrain", "  train_iters: 100                    # Optimizer steps to run."),
    ("pretrain", "  clip_grad: 1.0                      # Global gradient-norm clipping threshold; 0 disables."),
    ("plan", "output: ${hydra:runtime.output_dir}/plan.yaml  # Where the plan is written."),
])
def test_help_shows_each_field_with_its_description(module, line):
    proc = run_cli(["-m", f"hetpipe.{module}", "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert line in proc.stdout.splitlines()
    assert "docs/coming_from_megatron.md" in proc.stdout
