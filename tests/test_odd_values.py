"""Every odd value is one line and exit 2, before anything is allocated (issue 44, point 9).

On main before this, ``train.global_batch_size=1000000000000`` grew to 24 GB
resident and was OOM-killed after 71 s with no line; ``model.hidden_size=1048576``
(an 8 TB allocation), ``cluster.transport.deadline_s=nan`` or ``inf`` and seeds
numpy or torch cannot take ended in tracebacks; ``optimizer.min_lr=nan`` was
accepted and poisoned the weights at step 12; ``optimizer.clip_grad=nan`` was
accepted. Each of those runs the user's command on the tiny model; the other
numeric fields' odd values go through the same schemas, checked in-process.
"""
from __future__ import annotations

import pytest

from omegaconf import OmegaConf

from conftest import run_cli
from hetpipe.errors import EXIT_BAD_INPUT, ConfigError
from hetpipe.models import model_preset
from hetpipe.schema.pretrain_config import PretrainConfig, resolve

# (override, the field the line must name)
ODD = [
    ("train.global_batch_size=1000000000000", "train.global_batch_size"),
    ("model.hidden_size=1048576", "model.hidden_size"),
    ("cluster.transport.deadline_s=nan", "cluster.transport.deadline_s"),
    ("cluster.transport.deadline_s=inf", "cluster.transport.deadline_s"),
    ("cluster.transport.deadline_s=-1", "cluster.transport.deadline_s"),
    ("train.seed=-1", "train.seed"),
    ("train.seed=1180591620717411303424", "train.seed"),
    ("optimizer.min_lr=nan", "optimizer.min_lr"),
    ("optimizer.lr=inf", "optimizer.lr"),
    ("optimizer.clip_grad=nan", "optimizer.clip_grad"),
]
# The same classes of value in the other numeric fields.
ALSO_ODD = [
    ("optimizer.weight_decay=nan", "optimizer.weight_decay"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2"),
    ("optimizer.adam_eps=nan", "optimizer.adam_eps"),
    ("partition.grad_bucket_mb=nan", "partition.grad_bucket_mb"),
    ("train.peak_tflops=inf", "train.peak_tflops"),
    ("model.norm_epsilon=nan", "model.norm_epsilon"),
    ("model.rotary_base=inf", "model.rotary_base"),
    ("planner.memory_gib.local=inf", "planner.memory_gib.local"),
    ("train.global_batch_size=262148", "train.global_batch_size"),  # 65537 microbatches of 4
]


@pytest.mark.parametrize("override,field", ODD, ids=[o for o, _ in ODD])
def test_an_odd_value_is_one_line_naming_its_field(tmp_path, override, field):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", override, f"hydra.run.dir={tmp_path}"],
                   timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == EXIT_BAD_INPUT, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("hetpipe: error: "), lines
    assert f"{field}=" in lines[0], lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("override,field", ALSO_ODD, ids=[o for o, _ in ALSO_ODD])
def test_every_numeric_field_refuses_the_same_values(override, field):
    cfg = OmegaConf.merge(OmegaConf.structured(PretrainConfig(model=model_preset("tiny_llama"))),
                          OmegaConf.from_dotlist([override]))
    with pytest.raises(ConfigError, match=f"^{field}="):
        resolve(cfg)


def test_the_largest_values_that_make_sense_still_pass():
    cfg = OmegaConf.merge(OmegaConf.structured(PretrainConfig(model=model_preset("tiny_llama"))),
                          OmegaConf.from_dotlist(["train.seed=4294967295", "optimizer.min_lr=0",
                                                  "train.global_batch_size=262144", "optimizer.adam_beta1=0"]))
    assert resolve(cfg).train.seed == 4294967295  # and 65536 microbatches of 4
