"""train.deterministic (hetpipe/determinism.py) and what it rests on: the
local launcher's environment for every rank.

CPU kernels are deterministic already, so on CPU the mode changes no number;
what these tests can show is the mode's plumbing (flags, the ranks'
environment, the record in metrics.jsonl and the checkpoint, one-line
refusals). That GPU runs repeat bit for bit is for GPUs.
"""
import json
import os

import pytest
import torch
from torch.nn.attention import SDPBackend

from conftest import run_cli, run_pretrain
from hetpipe import determinism
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
    for name in determinism.ENV:
        monkeypatch.delenv(name, raising=False)


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
            "from hetpipe.cluster import ClusterConfig, GroupConfig\n"
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
