"""The GPU benchmark driver, run on CPU ranks: every variant is a real pretrain
run, and the table carries the measured step beside the cost model's prediction."""
import argparse
import json
import sys

import pytest

from cli_zygote import python_shim
from conftest import REPO, USUAL_ENV, run_cli

pytestmark = pytest.mark.timeout(300)


def test_bench_driver_runs_variants_and_predicts_their_step(tmp_path, corpus_prefix):
    out = tmp_path / "bench"
    cpu = ["--set", "cluster.groups.0.device_type=CPU", "--set", "cluster.groups.1.device_type=CPU",
           "--set", "model.hidden_size=64", "--set", "model.ffn_hidden_size=160"]
    proc = run_cli(["scripts/bench_pp2_llm.py", "--out", str(out), "--gpus", "4",
                    "--model", "tiny_llama", "--seq-length", "32", "--microbatches", "4", "--layers", "2,2",
                    "--steps", "3", "--data", corpus_prefix,
                    "--variants", "tcp4+zero1+pure+sched=zb_v,tp2+sched=zb_h1", *cpu], timeout=280,
                   env={"PYTHON": python_shim(USUAL_ENV)})  # its runs fork from the zygote too
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


# Stands in for `python -m hetpipe.pretrain` and the peer: writes the numbers a
# healthy run writes, prints a plausible step line, then ends as FAKE_FATES
# says for its run (an exit status, a signal name, or "hang").
FAKE_RUNNER = """
import json, os, signal, sys, time
from pathlib import Path

argv = sys.argv[1:]
if argv[:2] == ["-m", "hetpipe.pretrain"]:
    run = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")))
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "loss": 9.5, "tflops_per_device": 512.0, "tokens_per_s": 20480.0, "mfu": 0.5,
             "step_time_s": 1.25} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    name = run.name
else:
    out = Path(argv[argv.index("--out") + 1])
    out.write_text(json.dumps({"losses": [9.5], "tflops_per_gpu": 480.0, "tokens_per_s": 19000.0,
                               "peak_mem_gib": [1.0, 1.0], "status": "ok"}))
    name = out.parent.name
print("step      3/3 | loss 9.5000 | 20,480 tok/s | 512.0 TFLOP/s/device", flush=True)
fate = json.loads(os.environ["FAKE_FATES"])[name]
if fate == "hang":
    time.sleep(60)
if isinstance(fate, str):
    os.kill(os.getpid(), getattr(signal, fate))
sys.exit(fate)
"""


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_pp2_llm

    return bench_pp2_llm


def test_a_run_that_exits_non_zero_is_failed_and_never_a_number(tmp_path, monkeypatch, capsys):
    bench = _bench(monkeypatch)
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    monkeypatch.setattr(bench, "PYTHON", [sys.executable, str(runner)])
    monkeypatch.setenv("FAKE_FATES", json.dumps({"nccl": 0, "nccl_sched-zb_v": 0, "direct": 1, "tcp4": "SIGKILL",
                                                 "gloo": "hang", "peer": 1}))
    out = tmp_path / "bench"
    monkeypatch.setattr(sys, "argv", ["bench_pp2_llm.py", "--out", str(out), "--model", "tiny_llama",
                                      "--seq-length", "32", "--microbatches", "4", "--layers", "2,2",
                                      "--timeout", "5", "--variants", "nccl,nccl+sched=zb_v,direct,tcp4,gloo,peer"])
    bench.main()
    results = json.loads((out / "results.json").read_text())["results"]
    numbers = ("tflops_per_gpu", "tokens_per_s", "mfu", "step_time_s", "losses", "steps_timed")
    # Each printed a step line and wrote its metrics, but only the runs that exited 0 count.
    assert results["nccl"]["tflops_per_gpu"] == 512.0 and "failed" not in results["nccl"]
    for name, why in (("direct", "exit 1"), ("tcp4", "signal SIGKILL"), ("gloo", "timeout after 5 s"),
                      ("peer", "exit 1")):
        assert results[name]["failed"] == why, results[name]
        assert not set(numbers) & set(results[name]), results[name]
    assert results["direct"]["rc"] == 1 and results["tcp4"]["rc"] == -9
    # The table: the split each ran (zb_v's V halves 2,2), "failed (...)" where
    # a number would be, and ratios only between runs that did not fail (the
    # failed peer gives nccl no "x peer").
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (out / "results.md").read_text().splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["nccl"][:2] == ["2,2", "512.0"] and rows["nccl"][5] == "1.000"
    assert rows["nccl+sched=zb_v"][:2] == ["1,1,1,1", "512.0"]
    for name, why in (("direct", "exit 1"), ("tcp4", "signal SIGKILL"), ("gloo", "timeout after 5 s"),
                      ("peer", "exit 1")):
        assert rows[name][1] == f"failed ({why})" and set(rows[name][2:]) <= {"-"}, rows[name]
    assert "FAILED (exit 1)" in capsys.readouterr().out


def _h100_cluster(*groups: str, size: int = 1, kind: str = "tcp"):
    from hetpipe.devices.cluster import ClusterConfig, GroupConfig, TransportConfig

    return ClusterConfig(name="h100", groups=[GroupConfig(name=g, vendor="nvidia", device_type="H100",
                                                          ranks_per_node=size) for g in groups],
                         transport=TransportConfig(kind=kind))


def test_layers_auto_is_the_planners_split_for_each_schedule(monkeypatch):
    """LLaMA-3-8B PP2 at seq 4096, 16 microbatches, bf16-pure on two declared
    H100s: each variant runs the split the planner finds for its own schedule
    and layout (no GPU needed to plan), the peer the nccl 1F1B run's."""
    from hetpipe.models import model_preset
    from hetpipe.partitioner.planner_config import PlannerConfig
    from hetpipe.partitioner.resolve import build_plan
    from hetpipe.partitioner.solver import plan_for
    from hetpipe.schema.pretrain_config import TrainConfig

    bench = _bench(monkeypatch)
    args = argparse.Namespace(model="llama8b", seq_length=4096, micro_batch_size=1, microbatches=16, steps=3,
                              warmup=1, profile=False, memory_snapshot=False,
                              precision="bf16-pure", data="demo", gpus=2, layers="auto",
                              set=["cluster.groups.0.device_type=H100"])
    model = model_preset("llama8b")
    train = TrainConfig(seq_length=4096, micro_batch_size=1, global_batch_size=16, precision="bf16-pure")
    one_group = dict(tp=1, dp=1, stages=[2], group_order=["nvidia"], recompute="auto")
    splits = {}
    for schedule in ("1f1b", "zb_h1", "zb_v"):
        expected = plan_for(model, _h100_cluster("nvidia", size=2), train, PlannerConfig(schedule=schedule, **one_group))
        splits[schedule] = bench.run_split(args, "nccl", set(), schedule)
        assert splits[schedule].layers == [s.layers for s in expected.stages]
        # ...passed as partition.layers, the run's plan is that split (zb_v: its V's four chunks).
        cfg = bench.run_config(bench.hetpipe_overrides(args, "nccl", set(), schedule, splits[schedule]))
        plan = build_plan(cfg.partition, cfg.cluster, cfg.model)
        assert [s.layers for s in plan.stages] == splits[schedule].layers and plan.schedule == schedule
        assert [s.recompute for s in plan.stages] == [s.recompute for s in expected.stages]
    assert len(splits["zb_v"].layers) == 4 and sum(splits["zb_v"].layers) == 32 and len(splits["1f1b"].layers) == 2
    # Two vendor groups of one H100 each, the device-direct boundary: the split of that layout and link.
    args.set = ["cluster.groups.0.device_type=H100", "cluster.groups.1.device_type=H100"]
    mixed = PlannerConfig(schedule="zb_v", tp=1, dp=1, stages=[1, 1], group_order=["nvidia", "amd"], recompute="auto")
    assert bench.run_split(args, "direct", set(), "zb_v").layers == \
        [s.layers for s in plan_for(model, _h100_cluster("nvidia", "amd", kind="direct"), train, mixed).stages]
    # The peer runs the nccl 1F1B split whatever its own schedule; tp2 keeps its even split.
    args.set = ["cluster.groups.0.device_type=H100"]
    assert bench.run_split(args, "peer", set(), "zbv") == (splits["1f1b"].layers, None, None)
    assert bench.run_split(args, "tp2", set(), "1f1b") is None
    # Given counts are taken as they are (zb_v halves each rank's into its V).
    args.layers = "17,15"
    assert bench.run_split(args, "nccl", set(), "zb_v") == ([9, 8, 7, 8], None, None)


def test_layers_auto_takes_the_planners_recomputation_per_stage(monkeypatch):
    """LLaMA-3-8B PP2 at seq 8192, micro-batch 2, bf16-pure on two declared H100s:
    1F1B fits 80 GB only if some layers recompute; --layers auto runs the planner's
    choice per stage (train.recompute lists), and the run's plan is exactly that."""
    from hetpipe.partitioner.resolve import resolve_plan

    bench = _bench(monkeypatch)
    args = argparse.Namespace(model="llama8b", seq_length=8192, micro_batch_size=2, microbatches=16, steps=3,
                              warmup=1, profile=False, memory_snapshot=False,
                              precision="bf16-pure", data="demo", gpus=2, layers="auto",
                              set=["cluster.groups.0.device_type=H100"])
    split = bench.run_split(args, "nccl", set(), "1f1b")
    assert split.recompute is not None and set(split.recompute) != {"none"}
    assert "recompute" in split.describe()
    cfg = bench.run_config(bench.hetpipe_overrides(args, "nccl", set(), "1f1b", split))
    plan = resolve_plan(cfg)
    assert [s.layers for s in plan.stages] == split.layers
    assert [s.recompute for s in plan.stages] == split.recompute
    assert [s.recompute_num_layers for s in plan.stages] == split.recompute_num_layers


def test_layers_auto_refuses_a_schedule_that_does_not_fit_before_any_run(tmp_path, monkeypatch, capfd):
    # GPipe keeps all 16 microbatches of LLaMA-3-8B at seq 8192, and fp32 main weights with
    # AdamW's state take 18 bytes a parameter: even full recomputation fits no H100.
    err = _refusal(["--out", str(tmp_path), "--layers", "auto", "--seq-length", "8192", "--microbatches", "16",
                    "--precision", "bf16", "--variants", "nccl+sched=gpipe",
                    "--set", "cluster.groups.0.device_type=H100"], monkeypatch, capfd)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--layers auto, variant nccl+sched=gpipe: llama8b does not fit" in lines[0]
    assert not list(tmp_path.iterdir())  # no run started
    assert "--layers '17,x'" in _refusal(["--out", str(tmp_path), "--layers", "17,x"], monkeypatch, capfd)


def test_sched_auto_runs_the_runs_own_plan_auto_and_reports_what_it_chose(tmp_path, monkeypatch):
    """``nccl+sched=auto`` is ``plan=auto planner.schedule=auto`` through the user's
    entry point (no split, schedule or recomputation given), and the table shows
    the schedule and split that run chose, read from the plan it wrote."""
    from hetpipe.partitioner.resolve import resolve_plan

    bench = _bench(monkeypatch)
    args = argparse.Namespace(model="llama8b", seq_length=4096, micro_batch_size=1, microbatches=16, steps=3,
                              warmup=1, profile=False, memory_snapshot=False,
                              precision="bf16-pure", data="demo", gpus=2, layers="17,15",
                              set=["cluster.groups.0.device_type=H100"])
    assert bench.run_split(args, "nccl", set(), "auto") is None  # --layers does not bind plan=auto
    overrides = bench.hetpipe_overrides(args, "nccl", set(), "auto", None)
    assert {"plan=auto", "planner.schedule=auto"} <= set(overrides)
    assert not [o for o in overrides if o.startswith(("partition.schedule", "partition.layers", "train.recompute"))]
    plan = resolve_plan(bench.run_config(overrides))
    # On two H100s at this shape the planner's fastest schedule is a zero-bubble one (issue 29: zb_v 1.040x 1f1b).
    assert plan.schedule in ("zb_h1", "zb_v")
    plan.save(tmp_path / "plan.yaml")
    split, chosen = bench.ran_split(tmp_path)
    assert split.layers == [s.layers for s in plan.stages] and chosen == f"{plan.schedule}: "
    assert bench.ran_split(tmp_path / "absent") == (None, "")


def test_profile_and_memory_snapshot_steps_come_after_the_timed_steps(monkeypatch):
    """--profile and --memory-snapshot each add one untimed step, after the timed ones,
    and the run's config carries each step's number."""
    bench = _bench(monkeypatch)
    args = argparse.Namespace(model="llama8b", seq_length=4096, micro_batch_size=1, microbatches=16, steps=3,
                              warmup=1, profile=True, memory_snapshot=True, precision="bf16-pure", data="demo",
                              gpus=2, layers="17,15", set=["cluster.groups.0.device_type=H100"])
    cfg = bench.run_config(bench.hetpipe_overrides(args, "nccl", set(), "1f1b", bench.run_split(args, "nccl", set(), "1f1b")))
    assert (cfg.train.train_iters, cfg.train.profile_step, cfg.train.memory_snapshot_step) == (5, 4, 5)
    args.profile = False
    cfg = bench.run_config(bench.hetpipe_overrides(args, "nccl", set(), "1f1b", bench.run_split(args, "nccl", set(), "1f1b")))
    assert (cfg.train.train_iters, cfg.train.profile_step, cfg.train.memory_snapshot_step) == (4, None, 4)


def test_the_peer_runs_the_counterpart_of_each_precision():
    """Under --precision bf16 the peer ran bf16-pure (same memory and loss as the bf16-pure
    call), so "x peer" compared unlike precisions; its flags now follow --precision."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_pp2_llm

    assert bench_pp2_llm.peer_precision_flags("bf16", []) == []  # fp32 master weights under autocast
    assert bench_pp2_llm.peer_precision_flags("bf16-autocast", []) == []
    assert bench_pp2_llm.peer_precision_flags("bf16-pure", []) == ["--bf16-weights"]
    assert bench_pp2_llm.peer_precision_flags("fp8", []) == ["--fp8", "tensorwise"]
    assert bench_pp2_llm.peer_precision_flags("fp8", ["train.fp8_recipe=rowwise"]) == ["--fp8", "rowwise"]
