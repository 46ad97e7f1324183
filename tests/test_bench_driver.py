"""The GPU benchmark driver, run on CPU ranks: every variant is a real pretrain
run, and the table carries the measured step beside the cost model's prediction."""
import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(300)


def test_bench_driver_runs_variants_and_predicts_their_step(tmp_path, corpus_prefix):
    out = tmp_path / "bench"
    cpu = ["--set", "cluster.groups.0.device_type=CPU", "--set", "cluster.groups.1.device_type=CPU",
           "--set", "model.hidden_size=64", "--set", "model.ffn_hidden_size=160"]
    proc = subprocess.run([sys.executable, "scripts/bench_pp2_llm.py", "--out", str(out), "--gpus", "4",
                           "--model", "tiny_llama", "--seq-length", "32", "--microbatches", "4", "--layers", "2,2",
                           "--steps", "3", "--data", corpus_prefix,
                           "--variants", "tcp4+zero1+pure+sched=zb_v,tp2+sched=zb_h1", *cpu],
                          cwd=REPO, text=True, capture_output=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    pp_dp = results["tcp4+zero1+pure+sched=zb_v"]
    assert pp_dp["rc"] == 0 and pp_dp["steps_timed"] == 2 and pp_dp["tokens_per_s"] > 0
    # PP2 x DP2 with ZeRO-1 under ZB-V really ran as planned: --layers 2,2
    # halved into the V (1,1,1,1), two chunks per rank...
    run = out / "tcp4_zero1_pure_sched-zb_v"
    plan, config = (run / "plan.yaml").read_text(), (run / "config.yaml").read_text()
    assert "dp: 2" in plan and "distributed: true" in config and "precision: bf16-pure" in config
    assert "schedule: zb_v" in plan and "num_chunks: 2" in plan and plan.count("layers: 1") == 4
    # The benchmark's optimizer schedule (shared with the peer): a long warmup, as a real run starts.
    assert "lr_warmup_iters: 2000" in config
    # ...and the cost model predicted that plan's step (its V split as given).
    assert pp_dp["predicted_step_s"] > 0
    # TP2 in the first group only, three stages, zero bubble; the planner
    # does not express per-group TP.
    zb = results["tp2+sched=zb_h1"]
    assert zb["rc"] == 0 and zb["predicted_step_s"] is None and "one TP degree" in zb["predicted_note"]
    assert "schedule: zb_h1" in (out / "tp2_sched-zb_h1" / "config.yaml").read_text()
    table = (out / "results.md").read_text()
    assert "| tcp4+zero1+pure+sched=zb_v |" in table and "step s (predicted)" in table


def _refusal(argv: list[str], monkeypatch, capsys) -> str:
    """The driver's command-line checks, run in this process (each subprocess
    would spend seconds importing torch only to print one line): the exit
    status must be 2, and what it wrote to stderr comes back."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_pp2_llm

    monkeypatch.setattr(sys, "argv", ["bench_pp2_llm.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench_pp2_llm.main()
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bench_driver_refuses_unknown_variants_and_misplaced_flags(tmp_path, monkeypatch, capsys):
    for variant in ("direct+cta2", "nccl+cta0", "nccl+fast", "peer+pure", "direct+sm4", "nccl+sm4+sm2",
                    "nccl+sched=interleaved_1f1b", "peer+sched=zb_h1", "nccl+sched=gpipe+sched=zb_h1"):
        err = _refusal(["--out", str(tmp_path), "--variants", variant], monkeypatch, capsys)
        assert f"unknown variant {variant!r}" in err and "+ctaN" in err
    err = _refusal(["--out", str(tmp_path), "--variants", "peer", "--peer-schedules", "1f1b,zbx"], monkeypatch, capsys)
    assert "unknown --peer-schedules ['zbx']" in err and "dualpipev" in err
