"""train.deterministic (hetpipe/training/determinism.py), compare's verdicts for
deterministic runs and against a noise floor (hetpipe/cli/compare_verdict.py), and
scripts/determinism_check.sh's CPU path.

CPU kernels are deterministic already, so on CPU the mode changes no number;
what these tests can show is the mode's plumbing (flags, the ranks'
environment, the record in metrics.jsonl and the checkpoint, one-line
refusals) and compare's verdicts on real runs. That GPU runs repeat bit for
bit is for scripts/determinism_check.sh on GPUs.
"""
import json
import os
import subprocess

import pytest
import torch
import yaml
from torch.nn.attention import SDPBackend

from cli_zygote import python_shim
from conftest import REPO, USUAL_ENV, run_cli, run_pretrain
from hetpipe.training import determinism
from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.layers import Attention, sdpa_preference, set_attention_backend


@pytest.fixture
def torch_flags_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def _without_determinism_env(monkeypatch):
    # Set first, so that teardown also removes what determinism.apply() sets (a bare delenv of
    # an unset variable records nothing: the variables stayed in the worker, and every later
    # command's environment differed from tests/cli_zygote.py's, which ran them fresh).
    for name in determinism.ENV:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_launch_env_keeps_the_users_variables_and_refuses_a_cublas_setting_torch_refuses(monkeypatch):
    _without_determinism_env(monkeypatch)
    assert determinism.launch_env(False) == {}
    assert determinism.launch_env(True) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring",
                                            "NCCL_PROTO": "Simple", "RCCL_MSCCL_ENABLE": "0",
                                            "RCCL_MSCCLPP_ENABLE": "0"}
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert "NCCL_ALGO" not in determinism.launch_env(True)
    assert "CUBLAS_WORKSPACE_CONFIG" not in determinism.launch_env(True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError) as refused:
        determinism.launch_env(True)
    assert str(refused.value) == ("train.deterministic=true needs CUBLAS_WORKSPACE_CONFIG to be one of :4096:8, "
                                  ":16:8 (torch refuses cuBLAS otherwise), but it is ':0:0': unset it or set "
                                  "one of them")


def test_apply_turns_the_mode_on_and_off_and_fills_in_a_missing_environment(monkeypatch, capsys,
                                                                            torch_flags_restored):
    _without_determinism_env(monkeypatch)
    determinism.apply(True, rank=0)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_PROTO"] == "Simple"
    assert capsys.readouterr().err == ""  # no CUDA started in this process: set in time, nothing to say
    determinism.apply(False, rank=0)  # the next job of a multirun is not left in the mode
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_an_op_without_a_deterministic_variant_ends_in_one_line(torch_flags_restored):
    torch.use_deterministic_algorithms(True)
    with pytest.raises(ConfigError) as refused, determinism.refusals_reported():
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))  # torch has no deterministic put_
    assert str(refused.value) == (f"train.deterministic=true: torch {torch.__version__} has no deterministic "
                                  "put_, which this run needs; run with train.deterministic=false")
    with pytest.raises(RuntimeError, match="shape"), determinism.refusals_reported():  # other errors pass
        torch.zeros(3).view(2, 2)


def test_deterministic_attention_prefers_flash_and_never_cudnn():
    assert sdpa_preference("auto", deterministic=True) == (SDPBackend.FLASH_ATTENTION,
                                                           SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    assert sdpa_preference("cudnn", deterministic=True)[0] == SDPBackend.FLASH_ATTENTION
    assert sdpa_preference("math", deterministic=True)[0] == SDPBackend.MATH
    cfg = model_preset("tiny_llama")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for deterministic in (False, True):
        model = build_model(cfg, seed=3)
        set_attention_backend(model, "cudnn", deterministic)
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        assert all((SDPBackend.CUDNN_ATTENTION in m.sdpa_backends) != deterministic for m in attention)
        losses.append(model(tokens, tokens).item())
    assert losses[0] == losses[1]  # CPU: the same kernel either way


def test_deterministic_gemms_leave_no_sms_to_an_nccl_boundary(capsys):
    """cuBLAS repeats its bits for a fixed number of SMs: a carveout on NCCL ranks
    only would give an NCCL run other GEMM kernels than a direct-channel run."""
    from types import SimpleNamespace

    applied = []
    topo = SimpleNamespace(rank=0, stage=SimpleNamespace(ranks=[0]), gemm_sm_carveout=lambda: 4,
                           apply_gemm_sm_carveout=lambda: applied.append(4) or 4)
    assert determinism.gemm_sm_carveout(topo, deterministic=False) == 4 and applied == [4]
    capsys.readouterr()
    assert determinism.gemm_sm_carveout(topo, deterministic=True) == 0 and applied == [4]
    assert capsys.readouterr().out == ("hetpipe: note: train.deterministic: the GEMMs leave no SMs to the NCCL "
                                       "boundary (no cluster.transport.gemm_sm_carveout), so they pick the kernels "
                                       "of a rank without one\n")
    topo.rank = 1  # not the stage's first rank: nothing to say
    assert determinism.gemm_sm_carveout(topo, deterministic=True) == 0 and capsys.readouterr().out == ""


def test_the_local_launcher_puts_env_in_every_rank_before_it_runs():
    # A forked rank gets the fork server's environment, not the launcher's:
    # only launch's env can reach it. os.getenv runs on each rank; rank 0's answer comes back.
    code = ("import os\n"
            "from hetpipe.devices.cluster import ClusterConfig, GroupConfig\n"
            "from hetpipe.launch.local import launch\n"
            "groups = [GroupConfig(name=n, vendor=n, device_type='CPU', ranks_per_node=1) for n in ('nvidia', 'amd')]\n"
            "cluster = ClusterConfig(name='probe', emulate=True, groups=groups)\n"
            "print(launch(cluster, os.getenv, 'HETPIPE_PROBE', env={'HETPIPE_PROBE': 'from the launcher'}))\n"
            "print(os.getenv('HETPIPE_PROBE'))\n")
    proc = run_cli(["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["from the launcher", "None"]


def test_a_deterministic_run_says_so_in_its_rows_banner_and_checkpoint(tmp_path, corpus_prefix):
    ckpt = tmp_path / "ckpt"
    proc, rows = run_pretrain(tmp_path / "run", [
        "+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.train_iters=4",
        "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "logging.progress=false",
        "cluster=single", "cluster.groups.0.device_type=CPU", f"data.path={corpus_prefix}",
        "train.deterministic=true", f"checkpoint.save_dir={ckpt}"])
    assert [row["deterministic"] for row in rows] == [True] * 4
    assert ", fp32, deterministic (CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring, NCCL_PROTO=Simple), " \
        in proc.stdout
    state = json.loads((ckpt / "iter_0000004" / "trainer_state.json").read_text())
    assert state["extra"]["deterministic"] is True


# ---------------------------------------------------------- the script on CPU, and compare on its runs

@pytest.fixture(scope="module")
def check(tmp_path_factory, corpus_prefix):
    """The script's CPU path in two calls, as on a machine that limits one command's time:
    the deterministic runs, then the others into the same directory."""
    out = tmp_path_factory.mktemp("determinism_check")
    env = dict(os.environ, PYTHON=python_shim(USUAL_ENV), PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    calls = [subprocess.run(["bash", str(REPO / "scripts" / "determinism_check.sh"), "--cpu", "--phase", phase,
                             "--data", corpus_prefix, "--out", str(out)], cwd=REPO, env=env, text=True,
                            capture_output=True, timeout=300) for phase in ("det", "plain")]
    return out, calls[1], calls[0]


def _tables(stdout):
    """The Markdown tables the script prints last, each a list of rows (lists of cells)."""
    tables, rows = [], None
    for line in stdout.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if rows is None:
                rows = []
                tables.append(rows)
            elif set(cells) <= {"---"}:
                continue
            rows.append(cells)
        else:
            rows = None
    return tables


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(420)
def test_check_script_cpu_path_proves_bitwise_runs_and_prints_the_cost_last(check):
    out, proc, first = check
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    runs, verdicts, cost = _tables(first.stdout)[-3:]
    assert [r[1] for r in runs[1:]] == ["ok"] * 4 + ["not run (--phase det)"] * 4
    assert [r[2] for r in verdicts[1:]] == ["PASS (bitwise identical; deterministic runs)"] * 3 + ["", ""]
    assert [r[1] for r in cost[1:]] == ["-"] * 3
    # The second call keeps the first's runs and ends with every table whole.
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    runs, verdicts, cost = _tables(proc.stdout)[-3:]
    assert [r[:2] for r in runs[1:]] == [[name, "ok (earlier call)"] for name in (
        "gloo_det_a", "gloo_det_b", "direct_det", "tcp_det")] + [[name, "ok"] for name in (
        "gloo_a", "gloo_b", "direct", "tcp")]
    assert [r[1:] for r in verdicts[1:]] == [
        ["gloo_det_b", "PASS (bitwise identical; deterministic runs)"],
        ["direct_det", "PASS (bitwise identical; deterministic runs)"],
        ["tcp_det", "PASS (bitwise identical; deterministic runs)"],
        ["direct", "PASS (bitwise identical; the reference's two runs are bitwise identical)"],
        ["tcp", "PASS (bitwise identical; the reference's two runs are bitwise identical)"]]
    assert cost[0] == ["boundary", "step s", "step s deterministic", "cost"]
    assert [r[0] for r in cost[1:]] == ["gloo", "direct", "tcp"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in cost[1:])
    # The deterministic runs say so in every row, on the banner and in the noise report; the others nowhere.
    assert all(row.get("deterministic") is True for row in _rows(out / "tcp_det") if "loss" in row)
    assert not any("deterministic" in row for row in _rows(out / "tcp"))
    assert ("fp32, deterministic (CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring, NCCL_PROTO=Simple), "
            in (out / "direct_det.log").read_text())
    assert "deterministic (train.deterministic=true): gloo_det_a, gloo_det_b, direct_det, tcp_det" in \
        (out / "deterministic.txt").read_text()
    # On CPU the mode changes no number: the plain runs' curve is the deterministic runs'.
    assert [r["loss"] for r in _rows(out / "tcp")] == [r["loss"] for r in _rows(out / "gloo_det_a")]


@pytest.fixture(scope="module")
def noisy(check, tmp_path_factory):
    """Real runs of gloo_a's configuration on one rank that differ from it only in
    summation order (micro-batch size 1 or 4 instead of 2: the same gradients,
    rounded otherwise), with and without the mode; and one whose learning rate is
    0.1 % higher: a real difference, small but far beyond rounding."""
    out, proc, _ = check
    assert proc.returncode == 0
    given = yaml.safe_load((out / "gloo_a" / ".hydra" / "overrides.yaml").read_text())
    base = [o for o in given if not o.startswith(("cluster=", "partition.layers=", "train.micro_batch_size="))]
    base += ["cluster=single", "cluster.groups.0.device_type=CPU", "partition.layers=[4]"]
    sweep = tmp_path_factory.mktemp("noisy")
    for args in (["-m", *base, "train.micro_batch_size=1,4", "train.deterministic=false,true",
                  f"hydra.sweep.dir={sweep}"],
                 [*base, "train.micro_batch_size=2", "optimizer.lr=3.003e-3", f"hydra.run.dir={sweep / 'lr'}"]):
        # One thread: tensors this small only lose from more (tests/conftest.py's one_thread).
        proc = run_cli(["-m", "hetpipe.pretrain", *args], timeout=300, env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    # The sweep's jobs in order: (mbs 1, plain), (1, deterministic), (4, plain), (4, deterministic).
    return {"mbs1": sweep / "0", "mbs4": sweep / "2", "mbs4_det": sweep / "3", "lr": sweep / "lr"}


def _verdicts(stdout):
    lines = stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("training loss ")))
    return {line.split()[0]: line for line in lines[start + 1:] if line and not line.startswith("validation")}


@pytest.mark.timeout(420)
def test_compare_fails_only_beyond_the_noise_floor(check, noisy):
    out = check[0]
    ref, noise = out / "gloo_a", noisy["mbs4"]
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(noisy["mbs1"]), str(noisy["lr"]), "--noise-ref", str(noise),
                    "--out", str(out / "noise_report")])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "noise floor: gloo_a against 2, a second run of its configuration" in proc.stdout
    rows = _verdicts(proc.stdout)
    floor = rows["0"].split()[8:10]  # the floor, beside each verdict
    assert floor == rows["lr"].split()[8:10] and float(floor[0]) > 0
    assert " PASS (within noise: " in rows["0"] and rows["0"].endswith("x floor, k=4)")
    assert " FAIL (beyond noise: " in rows["lr"]
    assert "curves differ beyond tolerance" in proc.stdout
    md = (out / "noise_report" / "compare.md").read_text()
    assert "| floor max rel | floor mean rel | verdict |" in md and "Verdict: **FAIL**" in md
    # Within noise alone: exit 0. An explicit --rtol is the user's word for every pair.
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(noisy["mbs1"]), "--noise-ref", str(noise)])
    assert proc.returncode == 0 and "all runs agree" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(noisy["mbs1"]), "--noise-ref", str(noise), "--rtol", "0"])
    assert proc.returncode == 1 and _verdicts(proc.stdout)["0"].endswith(" FAIL")


@pytest.mark.timeout(420)
def test_two_deterministic_runs_must_be_bitwise_whatever_the_noise(check, noisy):
    out = check[0]
    # Rounding-level apart, within the noise floor - but both deterministic: not noise, a difference.
    proc = run_cli(["-m", "hetpipe.compare", str(out / "gloo_det_a"), str(noisy["mbs4_det"]), str(out / "tcp_det"),
                    "--noise-ref", str(noisy["mbs4"])])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _verdicts(proc.stdout)
    assert rows["3"].endswith(" FAIL (deterministic runs: bitwise identical required)")
    assert rows["tcp_det"].endswith(" PASS (bitwise identical; deterministic runs)")
    assert "deterministic (train.deterministic=true): gloo_det_a, 3, tcp_det; two of them pass only bitwise " \
           "identical" in proc.stdout
    # A noise run that shares no step with the reference is one line, exit 2.
    lone = out / "lone"
    lone.mkdir()
    (lone / "metrics.jsonl").write_text(json.dumps({"step": 99, "loss": 1.0}) + "\n")
    proc = run_cli(["-m", "hetpipe.compare", str(out / "gloo_a"), str(out / "tcp"), "--noise-ref", str(lone)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "share no steps" in proc.stderr
