"""The torch.distributed.pipelining peer trains the same model on the same data as we do.

``scripts/bench_pipelining_peer.py`` runs PyTorch's own Schedule1F1B (or
another of its schedules, ``--schedule``) over two spawned ranks (gloo on a CPU here). Its per-step losses must equal our
single-process trainer's (same seed, weights, data order, optimizer and LR
schedule) to fp32 rounding: the two differ only in summation orders.
"""
import json
import sys

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.timeout(180)

STEPS = 3
MODEL = ["hidden_size=64", "ffn_hidden_size=160"]
SHAPE = dict(seq_length=32, micro_batch_size=2, microbatches=4)
OPT = ["lr=3e-3", "clip_grad=0.5"]


def _peer(tmp_path, data, *extra, name="peer", env=None):
    out = tmp_path / f"{name}.json"
    args = ["scripts/bench_pipelining_peer.py", "--model", "tiny_llama", "--set", *MODEL, "--layers", "1,3",
            "--seq-length", str(SHAPE["seq_length"]), "--micro-batch-size", str(SHAPE["micro_batch_size"]),
            "--microbatches", str(SHAPE["microbatches"]), "--steps", str(STEPS), "--warmup", "1",
            "--data", data, "--device", "cpu", "--opt", *OPT, "--out", str(out), *extra]
    proc = run_cli(args, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(out.read_text()), lines


@pytest.fixture(scope="module")
def ours(tmp_path_factory, corpus_prefix):
    run_dir = tmp_path_factory.mktemp("ours") / "single"
    global_batch = SHAPE["micro_batch_size"] * SHAPE["microbatches"]
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", *(f"model.{kv}" for kv in MODEL),
                    f"train.train_iters={STEPS}", f"train.seq_length={SHAPE['seq_length']}",
                    f"train.micro_batch_size={SHAPE['micro_batch_size']}", f"train.global_batch_size={global_batch}",
                    "train.log_interval=1", *(f"optimizer.{kv}" for kv in OPT), "cluster.groups.0.device_type=CPU",
                    "logging.progress=false", f"data.path={corpus_prefix}", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def test_peer_losses_match_our_trainer(tmp_path, corpus_prefix, ours):
    result, lines = _peer(tmp_path, corpus_prefix)
    losses, norms = ours
    assert result["name"] == "pipelining_1f1b" and result["status"] == "ok"
    assert len(result["losses"]) == STEPS
    assert all(0 < loss < 10 for loss in result["losses"])  # ln(512) = 6.24 at init
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    # Clipping (0.5) was active and the global norm spans both ranks.
    assert result["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.5
    # One JSON line per step, then the summary over the steps after the warm-up.
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["warmup"] for s in steps] == [True, False, False]
    summary = lines[-1]
    assert summary["summary"] and summary["status"] == "ok"
    assert summary["tokens_per_s"] > 0 and summary["tflops_per_gpu"] > 0
    mean_time = sum(s["step_time_s"] for s in steps[1:]) / 2
    assert summary["step_time_s"] == pytest.approx(mean_time)
    assert result["peak_mem_gib"] == [None, None]  # no CUDA memory on a CPU


def test_head_in_loss_fused_ce_trains_the_same(tmp_path, corpus_prefix, ours):
    result, _ = _peer(tmp_path, corpus_prefix, "--head-in-loss", "--fused-ce", "--no-return-outputs",
                      name="head_in_loss")
    assert result["head"] == "loss_fn-fused" and result["return_outputs"] is False
    assert result["losses"] == pytest.approx(ours[0], rel=1e-5)


def test_zero_bubble_schedule_trains_the_same(tmp_path, corpus_prefix, ours):
    # ScheduleInterleavedZeroBubble with one stage per rank: the backward split
    # into input and weight gradients changes the order of work, not the sums.
    result, _ = _peer(tmp_path, corpus_prefix, "--schedule", "interleaved_zb", name="zb")
    assert result["name"] == "pipelining_interleaved_zb" and result["schedule"] == "ScheduleInterleavedZeroBubble"
    assert result["losses"] == pytest.approx(ours[0], rel=1e-5)


@pytest.mark.parametrize("schedule, layers", [("zbv", "1,3"), ("dualpipev", "1,1,1,1")])
def test_v_schedules_train_the_same(tmp_path, corpus_prefix, ours, schedule, layers):
    # Two stage modules per rank in a V (rank 0: stages 0 and 3, so the tokens
    # and the loss; rank 1: stages 1 and 2). Two per-rank counts are halved
    # into the V (1,3 -> 1,2,1,0), four are taken as they are.
    result, _ = _peer(tmp_path, corpus_prefix, "--schedule", schedule, "--layers", layers, name=schedule)
    assert result["schedule"] == {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}[schedule]
    assert result["layers"] == {"1,3": [1, 2, 1, 0], "1,1,1,1": [1, 1, 1, 1]}[layers]
    assert result["losses"] == pytest.approx(ours[0], rel=1e-5)
    assert result["grad_norms"] == pytest.approx(ours[1], rel=1e-5)


def test_a_v_split_with_an_empty_middle_stage_is_one_line():
    proc = run_cli(["scripts/bench_pipelining_peer.py", "--model", "tiny_llama", "--device", "cpu",
                    "--seq-length", "32", "--schedule", "zbv", "--layers", "3,1"], timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("bench_pipelining_peer: --layers [2, 1, 0, 1]: plan gives virtual stage(s) [2] "
                                   "no model units")


def test_out_of_memory_is_a_result(tmp_path, corpus_prefix):
    # The test hook raises CUDA's OutOfMemoryError in rank 1's forward at step
    # 2; rank 0, blocked on it, is ended and the run reports "oom".
    result, lines = _peer(tmp_path, corpus_prefix, name="oom", env={"BENCH_PEER_FAKE_OOM": "1,2"})
    assert result["status"] == "oom"
    assert result["oom"]["rank"] == 1 and result["oom"]["step"] == 2
    assert "out of memory" in result["oom"]["error"]
    assert result["tokens_per_s"] is None
    assert len(result["losses"]) == 1  # step 1 completed
    assert lines[-1]["status"] == "oom"


@pytest.mark.timeout(300)
def test_fp8_peer_trains_close_to_ours_and_refuses_bf16_weights(tmp_path, corpus_prefix, ours, capsys):
    """--fp8 (bench_pp2_llm --precision fp8): torchao's float8 linears in the peer's
    stages, on its fp32 master weights (CPU: torch's CPU FP8 GEMM, no autocast)."""
    pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")
    result, _ = _peer(tmp_path, corpus_prefix, "--fp8", "tensorwise", name="fp8")
    assert result["precision"] == "fp8-tensorwise+fp32" and result["status"] == "ok"
    losses, _ = ours
    assert result["losses"] != pytest.approx(losses, rel=1e-5)  # the FP8 GEMMs really ran
    assert result["losses"] == pytest.approx(losses, rel=0.03)
    sys.path.insert(0, str(REPO / "scripts"))
    from peer_options import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--model", "tiny_llama", "--fp8", "rowwise", "--bf16-weights"])
    assert refused.value.code == 2 and "--fp8 runs on fp32 master weights" in capsys.readouterr().err
