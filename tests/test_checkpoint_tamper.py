"""Checkpoints that cannot lie: an edited manifest, a renamed directory or a
malformed safetensors file is refused with one sentence naming the field (and
both values) or the file, before anything is loaded.

Tried as a user would: editing manifest.json's ``step`` made a run resume
"after step 30" from step 20's state, and an edited ``world_size`` loaded.
The CLI cases check the whole user path: exit status 2, exactly one
``hetpipe: error:`` line, no traceback.
"""
import hashlib
import json
import shutil
import struct

import pytest
import torch

from conftest import run_cli, run_pretrain
from hetpipe.checkpoint import CheckpointConfig, CheckpointError, load_checkpoint, load_hf_weights, save_checkpoint
from hetpipe.checkpoint.digest import SELF_CHECKSUM, manifest_digest
from hetpipe.models import build_model, model_preset
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.training.rank_setup import build_optimizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

CPU = torch.device("cpu")
LLAMA = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)
SPLIT = [(0, 3), (3, 6)]


@pytest.fixture
def ckpt(tmp_path):
    """A [2, 2] pipeline's checkpoint of step 2, saved as two ranks."""
    chunks = [build_model(LLAMA, seed=1234, units=r) for r in SPLIT]
    optimizers = [build_optimizer([c], OptimizerConfig(), CPU) for c in chunks]
    for rank in (1, 0):
        path = save_checkpoint(CheckpointConfig(save_dir=str(tmp_path / "ckpt")), "run", 2, [chunks[rank]],
                               optimizers[rank], {"consumed_samples": 16}, rank, 2, LLAMA, barrier=lambda: None)
    return path


def _edit(path, change, fix_checksum=False):
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    if fix_checksum:
        manifest[SELF_CHECKSUM] = manifest_digest(manifest)
    manifest_path.write_text(json.dumps(manifest, indent=1))


def _load(path):
    load_checkpoint(path, [build_model(LLAMA, seed=5, units=SPLIT[0])], rank=0, world_size=2)


def test_an_edited_step_names_the_field_and_both_values(ckpt):
    _edit(ckpt, lambda m: m.update(step=3))
    with pytest.raises(CheckpointError, match=r"manifest\.json says step 3, but trainer_state\.json "
                                              r"\(checksummed\) says step 2"):
        _load(ckpt)


def test_an_edited_world_size_names_the_field_and_both_values(ckpt):
    _edit(ckpt, lambda m: m.update(world_size=3))
    with pytest.raises(CheckpointError, match=r"manifest\.json says world_size 3, but its ranks list holds "
                                              r"ranks 0-1 \(2\)"):
        _load(ckpt)


def test_a_renamed_directory_is_refused(ckpt):
    renamed = ckpt.with_name("iter_0000030")
    ckpt.rename(renamed)
    with pytest.raises(CheckpointError, match=rf"checkpoint directory {renamed} is named for step 30, but its "
                                              r"manifest\.json and trainer_state\.json say step 2"):
        _load(renamed)
    # A copy under a name of the user's own is still a checkpoint.
    shutil.copytree(renamed, ckpt.with_name("my-copy"))
    _load(ckpt.with_name("my-copy"))


def test_an_edited_model_and_any_other_edit_are_refused(ckpt):
    original = (ckpt / "manifest.json").read_text()
    _edit(ckpt, lambda m: m["model"].update(hidden_size=128))
    with pytest.raises(CheckpointError, match=r"manifest\.json's model gives embedding\.weight the shape "
                                              r"\[512, 128\], but its tensor index says embedding\.weight has "
                                              r"\[512, 64\]"):
        _load(ckpt)
    (ckpt / "manifest.json").write_text(original)
    _edit(ckpt, lambda m: m["model"].update(rotary_base=500000.0))  # no shape shows this one
    with pytest.raises(CheckpointError, match=r"manifest\.json was edited after it was written: its "
                                              r"manifest_sha256 does not match its contents"):
        _load(ckpt)


@pytest.mark.parametrize("header", [struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 16) + b"garbage, no json"],
                         ids=["huge-header-length", "garbage-json"])
def test_a_malformed_safetensors_header_names_the_file(ckpt, header):
    # A bad file whose manifest record was recomputed (by a bug, or by hand): the checksum matches.
    shard = ckpt / "model-rank00000.safetensors"
    shard.write_bytes(header)

    def fix_record(m):
        record = next(f for f in m["files"] if f["name"] == shard.name)
        record.update(sha256=hashlib.sha256(header).hexdigest(), size=len(header))

    _edit(ckpt, fix_record, fix_checksum=True)
    with pytest.raises(CheckpointError, match=rf"{shard} is not a readable safetensors file: .*header") as err:
        _load(ckpt)
    assert "\n" not in str(err.value)


def test_a_malformed_safetensors_header_in_a_hugging_face_directory_names_the_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hetpipe.models.hf import to_hf_config

    hf_dir = tmp_path / "hf"
    to_hf_config(LLAMA).save_pretrained(hf_dir)
    assert isinstance(transformers.AutoConfig.from_pretrained(hf_dir), transformers.PretrainedConfig)
    weights = hf_dir / "model.safetensors"
    for header in (struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 16) + b"garbage, no json"):
        weights.write_bytes(header)
        with pytest.raises(CheckpointError, match=rf"{weights} is not a readable safetensors file: .*header"):
            load_hf_weights(hf_dir, [build_model(LLAMA, seed=0)], LLAMA)


# -- through the CLI -----------------------------------------------------------

COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=8", "logging.progress=false",
          "cluster.groups.0.device_type=CPU"]


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory, corpus_prefix):
    root = tmp_path_factory.mktemp("cli")
    run_pretrain(root / "run", [*COMMON, f"data.path={corpus_prefix}", "train.train_iters=2",
                                f"checkpoint.save_dir={root / 'ckpt'}", "checkpoint.save_interval=2"])
    return root / "ckpt"


def _tampered(cli_checkpoint, tmp_path, how):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(cli_checkpoint, save_dir)
    path = save_dir / "iter_0000002"
    if how == "step":
        _edit(path, lambda m: m.update(step=30))
        return save_dir, f"{path / 'manifest.json'} says step 30, but trainer_state.json (checksummed) says step 2"
    if how == "world_size":
        _edit(path, lambda m: m.update(world_size=2))
        return save_dir, f"{path / 'manifest.json'} says world_size 2, but its ranks list holds ranks 0-0 (1)"
    renamed = save_dir / "iter_0000030"
    path.rename(renamed)
    return renamed, (f"checkpoint directory {renamed} is named for step 30, but its manifest.json and "
                     "trainer_state.json say step 2 (was it renamed? it should be iter_0000002)")


@pytest.mark.parametrize("how", ["step", "world_size", "renamed"])
def test_the_cli_refuses_a_tampered_checkpoint_in_one_line(cli_checkpoint, tmp_path, corpus_prefix, how):
    resume, message = _tampered(cli_checkpoint, tmp_path, how)
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "train.train_iters=4",
                    f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint.resume={resume}"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "resumed from" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert errors == [f"hetpipe: error: {message}"], proc.stderr[-2000:]
