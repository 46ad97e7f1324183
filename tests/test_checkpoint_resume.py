"""Checkpoints through the user's entry point: resume, reshard to another plan,
export to transformers, and plans chosen by the planner."""

import pytest

from conftest import run_cli, run_pretrain

pytestmark = pytest.mark.timeout(300)

COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=8", "optimizer.lr=3e-3",
          # A schedule that does not depend on train_iters, so a short run is a prefix of a long one.
          "optimizer.lr_warmup_iters=2", "optimizer.lr_decay_iters=8", "optimizer.clip_grad=0.5",
          "logging.progress=false", "cluster.groups.0.device_type=CPU"]


def _losses(tmp_path, name, data, *overrides):
    proc, rows = run_pretrain(tmp_path / name, [*COMMON, f"data.path={data}", *overrides])
    return {r["step"]: r["loss"] for r in rows}, proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    return _losses(tmp_path_factory.mktemp("ref"), "ref", corpus_prefix, "train.train_iters=8")[0]


@pytest.mark.torch_matrix
def test_resume_continues_bitwise(tmp_path, corpus_prefix, reference):
    ckpt = tmp_path / "ckpt"
    first, _ = _losses(tmp_path, "a", corpus_prefix, "train.train_iters=4",
                       f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=4")
    second, out = _losses(tmp_path, "b", corpus_prefix, "train.train_iters=8",
                          f"checkpoint.save_dir={ckpt}", "checkpoint.resume=latest")
    assert "resumed from" in out
    assert sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == reference


@pytest.mark.torch_matrix
def test_reshard_to_another_split_and_export(tmp_path, corpus_prefix, reference):
    ckpt = tmp_path / "ckpt"
    _losses(tmp_path, "a", corpus_prefix, "cluster=cpu_mixed", "partition.layers=[2,2]",
            "train.train_iters=4", f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=4")
    resumed, _ = _losses(tmp_path, "b", corpus_prefix, "cluster=cpu_mixed", "partition.layers=[3,1]",
                         "train.train_iters=8", f"checkpoint.save_dir={ckpt}", "checkpoint.resume=latest")
    for step in (5, 6, 7, 8):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6)

    out = tmp_path / "hf"
    proc = run_cli(["-m", "hetpipe.export", str(ckpt), str(out)])
    assert proc.returncode == 0, proc.stderr
    transformers = pytest.importorskip("transformers")
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    # min_new_tokens: the export names the byte tokenizer's end of document (256) as eos, which may come first.
    generated = model.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)

    # The exported directory seeds a continued-pretraining run on another split:
    # its first loss is that of the trained weights, not of a fresh init.
    seeded, _ = _losses(tmp_path, "seeded", corpus_prefix, "cluster=cpu_mixed", "partition.layers=[1,3]",
                        "train.train_iters=1", f"checkpoint.load_hf={out}")
    assert seeded[1] < reference[1] - 0.5
    # The same weights cut into tensor-parallel shards give the same loss.
    seeded_tp, _ = _losses(tmp_path, "seeded_tp", corpus_prefix, "cluster=cpu_homogeneous", "partition.tp=2",
                           "train.train_iters=1", f"checkpoint.load_hf={out}")
    assert seeded_tp[1] == pytest.approx(seeded[1], rel=1e-5)


def test_corrupted_checkpoint_is_refused_by_name(tmp_path, corpus_prefix):
    ckpt = tmp_path / "ckpt"
    _losses(tmp_path, "a", corpus_prefix, "train.train_iters=2", f"checkpoint.save_dir={ckpt}",
            "checkpoint.save_interval=2")
    shard = next((ckpt / "iter_0000002").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}",
                    f"hydra.run.dir={tmp_path / 'b'}", "train.train_iters=4",
                    f"checkpoint.save_dir={ckpt}", "checkpoint.resume=latest"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert shard.name in proc.stderr


def test_a_shard_another_rank_refuses_is_never_called_resumed(tmp_path, corpus_prefix):
    # Rank 0's part loads; rank 1's model shard is corrupted. The job stops with
    # rank 1's line, and rank 0 never said it had resumed.
    ckpt = tmp_path / "ckpt"
    _losses(tmp_path, "a", corpus_prefix, "cluster=cpu_mixed", "train.train_iters=2",
            f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2")
    shard = ckpt / "iter_0000002" / "model-rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "cluster=cpu_mixed",
                    f"hydra.run.dir={tmp_path / 'b'}", "train.train_iters=4",
                    f"checkpoint.save_dir={ckpt}", "checkpoint.resume=latest"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{shard} is corrupted" in proc.stderr and "resumed from" not in proc.stdout, proc.stdout[-2000:]


def test_plan_auto_and_plan_file(tmp_path, corpus_prefix):
    _, out = _losses(tmp_path, "auto", corpus_prefix, "cluster=cpu_mixed", "plan=auto",
                     "train.train_iters=2", "model.num_layers=6")
    plan = (tmp_path / "auto" / "plan.yaml").read_text()
    assert "python -m hetpipe.plan" in plan  # the planner's notes came along
    # The same plan, read back from its file, runs too.
    _losses(tmp_path, "file", corpus_prefix, "cluster=cpu_mixed", f"plan={tmp_path / 'auto' / 'plan.yaml'}",
            "train.train_iters=2", "model.num_layers=6")
    bad = tmp_path / "tp2.yaml"
    bad.write_text(plan.replace("tp: 1", "tp: 2", 1))
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "cluster=cpu_mixed",
                    "model.num_layers=6", f"plan={bad}", f"hydra.run.dir={tmp_path / 'bad'}"])
    assert proc.returncode == 2 and "TP2" in proc.stderr and "Traceback" not in proc.stderr
