"""The pretraining entry point as a user runs it, and the trainer's arithmetic."""
import json
import math

import pytest

from conftest import fork_servers_started, log_python_starts, run_cli
from hetpipe.schema.pretrain_config import OptimizerConfig, resolve
from hetpipe.errors import ConfigError
from hetpipe.training.trainer import lr_at, train

TINY = {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 64, "train_iters": 6,
        "log_interval": 3}


def test_cfg_job_prints_full_8b_config_without_building_it():
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=llama8b", "--cfg", "job"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for line in ("hidden_size: 4096", "num_layers: 32", "num_attention_heads: 32",
                 "num_query_groups: 8", "ffn_hidden_size: 14336", "vocab_size: 128256",
                 "rotary_base: 500000.0", "max_position_embeddings: 8192"):
        assert line in proc.stdout
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=qwen2_7b", "--cfg", "job"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for line in ("hidden_size: 3584", "num_layers: 28", "num_query_groups: 4", "vocab_size: 152064",
                 "ffn_hidden_size: 18944", "add_qkv_bias: true", "rotary_base: 1000000.0"):
        assert line in proc.stdout


def test_tiny_llama_loss_falls_through_the_cli(tmp_path, corpus_prefix):
    run_dir = tmp_path / "run"
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", f"data.path={corpus_prefix}",
                    "train.train_iters=40", "train.seq_length=64", "train.global_batch_size=16",
                    "train.log_interval=20", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4",
                    f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples", "step_time_s"):
        assert key in rows[0]
    # A CPU run: TFLOP/s and MFU would mean nothing, so neither is written.
    assert not any("tflops_per_device" in r or "mfu" in r for r in rows)
    assert "TFLOP/s" not in proc.stdout and "MFU" not in proc.stdout
    assert rows[-1]["consumed_samples"] == 40 * 16
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.5  # ~ln(512): random init over the byte vocabulary
    assert last < first - 2.0, (first, last)
    assert "step     40/40 | loss" in proc.stdout
    assert (run_dir / "config.yaml").is_file()
    assert not (run_dir / "checkpoints").exists()  # no save_dir, no interval: no multi-GB surprise


def _cfg(data_path, **train):
    return resolve({"model": {"name": "tiny_llama", "num_layers": 2, "hidden_size": 64,
                              "ffn_hidden_size": 128, "num_attention_heads": 4,
                              "num_query_groups": 2, "vocab_size": 512,
                              "max_position_embeddings": 128},
                    "train": {**TINY, **train}, "data": {"path": data_path},
                    "logging": {"progress": False}})


def test_same_seed_same_losses_and_accumulation_matches_one_big_batch(tmp_path, corpus_prefix):
    a = train(_cfg(corpus_prefix), tmp_path / "a")
    b = train(_cfg(corpus_prefix), tmp_path / "b")
    assert a == b  # bitwise: seeded init and data order
    # 8 samples as 4 microbatches of 2 vs 1 microbatch of 8: the same gradient
    # up to fp32 summation order.
    accumulated = train(_cfg(corpus_prefix, micro_batch_size=2), tmp_path / "c")
    single = train(_cfg(corpus_prefix, micro_batch_size=8), tmp_path / "d")
    assert accumulated == pytest.approx(single, rel=1e-5)
    other_seed = train(_cfg(corpus_prefix, seed=7), tmp_path / "e")
    assert other_seed != a


CLI_RUN = ["+model=tiny_llama", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
           "logging.progress=false"]


def _iter_dirs(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))


def test_a_run_with_a_save_dir_ends_with_a_checkpoint(tmp_path, corpus_prefix, monkeypatch):
    # A one-rank job trains in the CLI's process: no fork server for ranks is started (about 2 CPU-s).
    starts = log_python_starts(tmp_path, monkeypatch)
    # No interval: the last step is saved because a save_dir was given (Megatron's end-of-run save).
    ckpt = tmp_path / "ckpt"
    proc = run_cli(["-m", "hetpipe.pretrain", *CLI_RUN, f"data.path={corpus_prefix}", "train.train_iters=3",
                    f"checkpoint.save_dir={ckpt}", f"hydra.run.dir={tmp_path / 'a'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _iter_dirs(ckpt) == ["iter_0000003"] and proc.stdout.count("saved checkpoint") == 1
    # An interval that lands on the last step saves it once.
    ckpt = tmp_path / "ckpt2"
    proc = run_cli(["-m", "hetpipe.pretrain", *CLI_RUN, f"data.path={corpus_prefix}", "train.train_iters=4",
                    f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2", f"hydra.run.dir={tmp_path / 'b'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _iter_dirs(ckpt) == ["iter_0000002", "iter_0000004"] and proc.stdout.count("saved checkpoint") == 2
    assert starts.read_text().count("hetpipe.pretrain") == 2 and fork_servers_started(starts) == 0


def test_a_checkpoint_from_before_megatrons_warmup_resumes_with_one_line(tmp_path, corpus_prefix, monkeypatch,
                                                                         capsys):
    import hetpipe.training.trainer as trainer

    def cfg(iters, resume=None):
        c = _cfg(corpus_prefix, train_iters=iters)
        c.checkpoint.save_dir, c.checkpoint.resume = str(tmp_path / "ckpt"), resume
        return c

    # Written as before the change: the trainer kept no state of its own in the checkpoint.
    monkeypatch.setattr(trainer, "_trainer_state", lambda *state: {})
    train(cfg(2), tmp_path / "a")
    monkeypatch.undo()
    capsys.readouterr()
    train(cfg(4, "latest"), tmp_path / "b")
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "warmup convention changed" in line]
    assert len(notes) == 1 and "optimizer.lr_warmup_style=one_ahead keeps the old one" in notes[0], out
    # The checkpoint this run wrote records its convention: no line when resuming it.
    train(cfg(6, "latest"), tmp_path / "c")
    out = capsys.readouterr().out
    assert "resumed from" in out and "warmup convention" not in out


def _megatron_lr(num_steps, init, max_lr, min_lr, warmup, decay, style):
    """Megatron-LM's OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py)
    for iteration-based runs, its num_steps being the optimizer steps already taken."""
    if warmup > 0 and num_steps <= warmup:
        return init + (max_lr - init) * num_steps / warmup
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def test_lr_schedule_warmup_then_cosine_to_min():
    opt = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14)
    lrs = [lr_at(s, opt, train_iters=20) for s in range(20)]
    # Megatron's warmup: the first step trains at lr_warmup_init (0), step W at lr.
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert all(x >= y for x, y in zip(lrs[4:], lrs[5:]))
    assert lrs[14:] == [0.1] * 6


@pytest.mark.parametrize("config", [
    dict(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14, lr_decay_style="cosine"),
    dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=10, lr_decay_iters=None, lr_decay_style="cosine"),
    dict(lr=1e-3, min_lr=0.0, lr_warmup_iters=3, lr_decay_iters=9, lr_decay_style="linear"),
    dict(lr=2e-3, min_lr=2e-4, lr_warmup_iters=5, lr_warmup_init=1e-4, lr_decay_iters=12,
         lr_decay_style="cosine"),
    dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_warmup_init=5e-4, lr_decay_style="constant"),
    dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, lr_decay_iters=8, lr_decay_style="linear"),
])
def test_lr_matches_megatrons_scheduler_step_for_step(config):
    train_iters = 20
    opt = OptimizerConfig(**config)
    decay = opt.lr_decay_iters or train_iters
    expected = [_megatron_lr(s, opt.lr_warmup_init, opt.lr, opt.min_lr, opt.lr_warmup_iters, decay,
                             opt.lr_decay_style) for s in range(train_iters)]
    assert [lr_at(s, opt, train_iters) for s in range(train_iters)] == pytest.approx(expected, rel=1e-12, abs=0)


def test_lr_values_by_hand_and_the_old_convention_by_name():
    # lr 1e-3 from lr_warmup_init 1e-4 over 3 steps, then linear to 0 at step 6 (thirds of lr).
    opt = OptimizerConfig(lr=1e-3, min_lr=0.0, lr_warmup_iters=3, lr_warmup_init=1e-4, lr_decay_iters=6,
                          lr_decay_style="linear")
    assert [lr_at(s, opt, 8) for s in range(8)] == pytest.approx(
        [1e-4, 4e-4, 7e-4, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0, 0.0], abs=1e-15)
    # hetpipe's earlier warmup, one step ahead, kept under its name.
    old = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14, lr_warmup_style="one_ahead")
    assert [lr_at(s, old, 20) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [lr_at(s, old, 20) for s in range(5, 20)] == [
        lr_at(s, OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14), 20)
        for s in range(5, 20)]


@pytest.mark.parametrize("bad, message", [
    (dict(lr_warmup_init=2e-3, lr=1e-3), "optimizer.lr_warmup_init=0.002 must be between 0 and optimizer.lr=0.001"),
    (dict(lr_warmup_style="late"), "optimizer.lr_warmup_style='late' must be one of megatron, one_ahead"),
])
def test_warmup_settings_are_checked(bad, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**bad)


def _one_error_line(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], errors[0]


@pytest.mark.parametrize("overrides,needle", [
    (["data.path=/nonexistent/corpus"], "/nonexistent/corpus"),
    (["train.seq_length=4096"], "max_position_embeddings=512"),
    (["model.vocab_size=200"], "vocab_size"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"], "global_batch_size=10"),
])
def test_bad_input_is_one_clear_line(tmp_path, overrides, needle):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", "train.train_iters=1",
                    f"hydra.run.dir={tmp_path}", *overrides], timeout=120)
    _one_error_line(proc, needle)


def test_corrupt_index_is_refused(tmp_path, corpus_prefix):
    import shutil
    prefix = tmp_path / "bad"
    shutil.copy(corpus_prefix + ".bin", str(prefix) + ".bin")
    data = bytearray(open(corpus_prefix + ".idx", "rb").read())
    data[:7] = b"NOTIDX!"
    (tmp_path / "bad.idx").write_bytes(bytes(data))
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", "train.train_iters=1",
                    f"data.path={prefix}", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    _one_error_line(proc, "bad.idx")


def test_unknown_model_and_missing_model_are_refused(tmp_path):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=llama9b", f"hydra.run.dir={tmp_path}"], timeout=60)
    assert proc.returncode != 0
    assert "Could not find 'model/llama9b'" in proc.stderr and "tiny_llama" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(["-m", "hetpipe.pretrain", f"hydra.run.dir={tmp_path}"], timeout=60)
    _one_error_line(proc, "+model=NAME")


def test_config_values_are_checked():
    with pytest.raises(ConfigError, match="lr_decay_style"):
        resolve({"model": {"name": "m"}, "optimizer": {"lr_decay_style": "exp"}})
    with pytest.raises(ConfigError, match="train.precision"):
        resolve({"model": {"name": "m"}, "train": {"precision": "fp4"}})
    with pytest.raises(ConfigError, match="transport.kind"):
        resolve({"model": {"name": "m"}, "cluster": {"transport": {"kind": "carrier-pigeon"}}})


def test_multirun_sweeps_partition_plans(tmp_path, corpus_prefix, monkeypatch):
    starts = log_python_starts(tmp_path / "log", monkeypatch)
    proc = run_cli(["-m", "hetpipe.pretrain", "-m", "+model=tiny_llama", "cluster=cpu_mixed",
                    "partition.layers=[1,3],[3,1]", "train.train_iters=2", "train.seq_length=32",
                    "train.global_batch_size=4", "logging.progress=false",
                    f"data.path={corpus_prefix}", f"hydra.sweep.dir={tmp_path}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = sorted(p.read_text() for p in tmp_path.glob("*/plan.yaml"))
    assert len(plans) == 2 and plans[0] != plans[1]
    assert all(len((p.parent / "metrics.jsonl").read_text().splitlines()) == 2
               for p in tmp_path.glob("*/plan.yaml"))
    # Both two-rank jobs forked their ranks from the one server the CLI started as it began.
    assert fork_servers_started(starts) == 1


def test_receives_posted_ahead_default_to_one_on_nccl_boundaries_only():
    from types import SimpleNamespace

    import torch

    from hetpipe.training.rank_setup import _recv_ahead

    cfg = resolve({"model": {"name": "m"}})
    gpu_nccl = SimpleNamespace(device=torch.device("cuda", 0), p2p_groups={(0, 1): object()})
    gpu_cross_vendor = SimpleNamespace(device=torch.device("cuda", 0), p2p_groups={})
    cpu = SimpleNamespace(device=torch.device("cpu"), p2p_groups={(0, 1): object()})
    assert [_recv_ahead(cfg, t) for t in (gpu_nccl, gpu_cross_vendor, cpu)] == [1, 2, 2]
    cfg = resolve({"model": {"name": "m"}, "partition": {"recv_ahead": 3}})
    assert _recv_ahead(cfg, gpu_nccl) == 3
    with pytest.raises(ConfigError, match="partition.recv_ahead=0"):
        resolve({"model": {"name": "m"}, "partition": {"recv_ahead": 0}})


def test_nccl_boundary_communicators_are_capped_at_the_configured_ctas(monkeypatch):
    """cluster.transport.nccl_max_ctas reaches the NCCL config of boundary groups
    (checked with torch.distributed stubbed: this machine's torch has no NCCL)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hetpipe.devices.cluster import GroupConfig
    from hetpipe.training.topology import Topology

    class Options:
        def __init__(self):
            self.config = SimpleNamespace(max_ctas=None)

    made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or object())
    me = SimpleNamespace(rank=0, device=torch.device("cuda", 0))
    gpus = GroupConfig(name="nvidia", vendor="nvidia", device_type="H200")
    Topology._new_group(me, [0, 1], gpus, timeout=timedelta(seconds=5), max_ctas=4)
    Topology._new_group(me, [0, 1], gpus)  # TP/DP groups: NCCL's own choice
    (_, boundary), (_, other) = made
    assert boundary["backend"] == "nccl" and boundary["pg_options"].config.max_ctas == 4
    assert boundary["timeout"] == timedelta(seconds=5) and "pg_options" not in other
    assert resolve({"model": {"name": "m"}}).cluster.transport.nccl_max_ctas == 2
    assert resolve({"model": {"name": "m"}, "cluster": {"transport": {"nccl_max_ctas": None}}}) \
        .cluster.transport.nccl_max_ctas is None
    with pytest.raises(ConfigError, match="nccl_max_ctas=0"):
        resolve({"model": {"name": "m"}, "cluster": {"transport": {"nccl_max_ctas": 0}}})


def test_gemms_leave_sms_to_the_nccl_boundary(monkeypatch):
    """cluster.transport.gemm_sm_carveout: automatic on NVIDIA ranks with NCCL
    boundary communicators (max_ctas per communicator), explicit values win,
    nothing elsewhere; applying it sets torch's carveout and routes GEMMs
    through cuBLASLt (stubbed: this machine has no GPU)."""
    from types import SimpleNamespace

    import torch

    from hetpipe.devices.cluster import TransportConfig
    from hetpipe.training.topology import Topology

    def rank(device="cuda", groups=2, **transport):
        cluster = SimpleNamespace(transport=TransportConfig(**transport))
        ns = SimpleNamespace(cluster=cluster, device=torch.device(device), p2p_groups=dict.fromkeys(range(groups)))
        ns.gemm_sm_carveout = lambda: Topology.gemm_sm_carveout(ns)
        return ns

    monkeypatch.setattr(torch.version, "hip", None)
    me = rank()
    assert Topology.gemm_sm_carveout(me) == 2 * 2  # two directions, 2 CTAs each
    me = rank(groups=4, nccl_max_ctas=1)  # a middle stage
    assert Topology.gemm_sm_carveout(me) == 4
    for me, want in ((rank(gemm_sm_carveout=6), 6), (rank(gemm_sm_carveout=0), 0), (rank(nccl_max_ctas=None), 0),
                     (rank(device="cpu"), 0), (rank(groups=0), 0)):
        assert Topology.gemm_sm_carveout(me) == want
    calls = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda n: calls.append(("carveout", n)))
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda lib: calls.append(("blas", lib)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    me = rank()
    assert Topology.apply_gemm_sm_carveout(me) == 4 and calls == [("carveout", 4), ("blas", "cublaslt")]
    me = rank(gemm_sm_carveout=132)
    with pytest.raises(ConfigError, match="gemm_sm_carveout=132 leaves no SMs of this GPU's 132"):
        Topology.apply_gemm_sm_carveout(me)
    me = rank(device="cpu")
    calls.clear()
    assert Topology.apply_gemm_sm_carveout(me) == 0 and calls == []
    monkeypatch.setattr(torch.version, "hip", "7.0")  # ROCm: hipBLASLt has no SM target in torch
    me = rank()
    assert Topology.gemm_sm_carveout(me) == 0
    with pytest.raises(ConfigError, match="gemm_sm_carveout=-1"):
        resolve({"model": {"name": "m"}, "cluster": {"transport": {"gemm_sm_carveout": -1}}})


def test_a_zero_learning_rate_is_a_run_that_updates_nothing():
    opt = OptimizerConfig(lr=0.0, min_lr=0.0, lr_warmup_iters=2)
    assert [lr_at(s, opt, 10) for s in range(10)] == [0.0] * 10
    with pytest.raises(ConfigError, match=r"need 0 <= min_lr <= lr, got lr=0.0, min_lr=0.1"):
        OptimizerConfig(lr=0.0, min_lr=0.1)


@pytest.mark.parametrize("args, line", [
    (["+model=tiny_llama", "train.bogus=1"],
     "hetpipe: error: bad command line: Could not override 'train.bogus': Key 'bogus' not in 'TrainConfig'"),
    (["+model=tiny_llama", "train.seq_length=abc"],
     "hetpipe: error: bad command line: Error merging override train.seq_length=abc: Value 'abc' of type 'str' "
     "could not be converted to Integer"),
    (["+model=llama9b"], "hetpipe: error: bad command line: In 'pretrain': Could not find 'model/llama9b' "
                         "(did you mean +model=llama8b?) (available: llama31_8b, llama8b, qwen2_7b, qwen3_8b, tiny_llama, tiny_qwen2, tiny_qwen3)"),
])
def test_a_command_line_hydra_cannot_compose_is_one_line_and_exit_2(args, line):
    proc = run_cli(["-m", "hetpipe.pretrain", *args, "--cfg", "job"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr
