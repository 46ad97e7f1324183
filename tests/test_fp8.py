"""train.precision=fp8: torchao float8 decoder linears on bf16 working copies of fp32 main weights.

What a user would check: fp8 on a device without FP8 (a CPU, an A100) stops
in one line that says how to run that group in bf16; each device computes in
its catalog's FP8 pair; the converted model keeps the state dict of the bf16
one and its weight gradients land in the fp32 ``.grad``; a pipeline whose
groups run fp8 and bf16 trains; and checkpoints are precision-neutral (an
fp8 run resumes as bf16 and the reverse). CPU ranks emulate FP8 here through
torch's CPU ``_scaled_mm``: the catalog's CPU entry is given an FP8 format by
the same ``planner.catalog`` override a user adds a device with.
"""

import pytest
import torch

from conftest import run_cli, run_pretrain
from hetpipe.devices.catalog import CATALOG, FP8_FORMATS
from hetpipe.errors import ConfigError
from hetpipe.devices.group_precision import fp8_format
from hetpipe.models import build_model
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.precision import Bf16Weights, activation_dtype

float8 = pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")
from hetpipe.models.fp8 import convert_to_fp8, float8_config, is_float8  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CFG = ModelConfig(name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=64, max_position_embeddings=64)
CPU_FP8 = "+planner.catalog={CPU: {fp8_format: e4m3fn, peak_fp8_tflops: 2.0}}"


def test_the_catalog_gives_each_fp8_device_its_format_and_a_dense_peak_above_bf16():
    for key, spec in CATALOG.items():
        if spec.fp8_format is not None:
            assert spec.fp8_format in FP8_FORMATS and spec.peak_fp8_tflops >= 1.9 * spec.peak_bf16_tflops, key
    assert [CATALOG[k].fp8_format for k in ("H200", "B200", "L40S", "MI355X", "MI300X", "MI325X")] == \
        ["e4m3fn"] * 4 + ["e4m3fnuz"] * 2
    assert (CATALOG["H200"].peak_bf16_tflops, CATALOG["H200"].peak_fp8_tflops) == (989.0, 1979.0)
    assert all(CATALOG[k].fp8_format is None for k in ("A100", "MI210", "MI250X", "CPU"))


def test_a_group_without_fp8_is_refused_with_the_setting_that_asked_and_the_way_out():
    with pytest.raises(ConfigError, match=r"train.precision=fp8 needs FP8 tensor cores, and group 'amd' runs on "
                                          r"A100.*cluster.groups.1.precision=bf16"):
        fp8_format("fp8", None, 1, "amd", "A100")
    with pytest.raises(ConfigError, match=r"^cluster.groups.0.precision=fp8 needs .* runs on MI210"):
        fp8_format("bf16", "fp8", 0, "nvidia", "MI210")
    assert fp8_format("fp8", None, 0, "amd", "MI325X") == "e4m3fnuz"
    assert fp8_format("fp8", None, 1, "nvidia", "H200") == "e4m3fn"


@pytest.mark.parametrize("fmt,e4m3,e5m2", [("e4m3fn", torch.float8_e4m3fn, torch.float8_e5m2),
                                           ("e4m3fnuz", torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)])
def test_each_recipe_computes_in_the_devices_fp8_pair(fmt, e4m3, e5m2):
    tensorwise = float8_config("tensorwise", fmt)
    assert (tensorwise.cast_config_input.target_dtype, tensorwise.cast_config_weight.target_dtype,
            tensorwise.cast_config_grad_output.target_dtype) == (e4m3, e4m3, e5m2)
    rowwise = float8_config("rowwise", fmt)  # torchao's rowwise casts gradients to e4m3 too
    assert {rowwise.cast_config_input.target_dtype, rowwise.cast_config_grad_output.target_dtype} == {e4m3}
    with pytest.raises(ConfigError, match="train.fp8_recipe='blockwise'"):
        float8_config("blockwise", fmt)


def test_decoder_linears_convert_keep_the_state_dict_and_unaligned_ones_stay_bf16():
    model, reference = build_model(CFG, seed=1), build_model(CFG, seed=1)
    assert convert_to_fp8([model], "tensorwise", "e4m3fn") == []
    converted = sorted(n for n, m in model.named_modules() if is_float8(m))
    assert converted == [f"layers.{i}.{p}" for i in range(2) for p in ("attention.out", "attention.qkv",
                                                                      "mlp.down", "mlp.gate_up")]
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    narrow = build_model(ModelConfig(**{**CFG.to_dict(), "ffn_hidden_size": 40}), seed=1)
    assert convert_to_fp8([narrow], "rowwise", "e4m3fn") == ["layers.0.mlp.down", "layers.1.mlp.down"]
    assert not is_float8(narrow.get_submodule("layers.0.mlp.down"))


def test_fp8_runs_on_the_working_copies_and_its_weight_gradients_land_in_fp32(one_thread):
    """Bf16Weights with gradient-accumulation fusion, as the trainer builds it: the float8
    linears keep their own forward (an FP8 GEMM), their gradient reaches the fp32 .grad through
    the working copy's cast, and it is close to bf16's but not bf16's."""
    grads = {}
    for mode in ("bf16", "fp8"):
        model = build_model(CFG, seed=1)
        if mode == "fp8":
            convert_to_fp8([model], "tensorwise", "e4m3fn")
        weights = Bf16Weights([model], fuse_linear_grads=True)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        with weights.swap(0):
            assert model.layers["0"].attention.qkv.weight.dtype == torch.bfloat16
            loss = model(tokens, tokens)
        loss.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and g.dtype == torch.float32 for g in grads[mode].values())
    name = "layers.0.mlp.gate_up.weight"
    assert not torch.equal(grads["fp8"][name], grads["bf16"][name])
    assert torch.allclose(grads["fp8"][name], grads["bf16"][name], rtol=0.2, atol=0.2 * grads["bf16"][name].abs().max())
    assert activation_dtype("fp8") == torch.bfloat16  # boundary messages and their gradients


COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.num_layers=4",
          "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=2",
          "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2", "optimizer.lr_decay_iters=6",
          "logging.progress=false"]


def test_fp8_on_cpu_ranks_stops_in_one_line(tmp_path, corpus_prefix):
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "cluster=cpu_mixed",
                    "train.precision=fp8", "cluster.groups.1.precision=bf16", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hetpipe: error: train.precision=fp8 needs FP8 tensor cores, and group 'nvidia' runs on CPU, which has "
        "none (device catalog): set cluster.groups.0.precision=bf16 to train that group in bf16"]


def _train(tmp_path, name, data, *overrides):
    proc, rows = run_pretrain(tmp_path / name, [*COMMON, f"data.path={data}", "cluster=cpu_mixed",
                                                "cluster.transport.kind=tcp", "partition.layers=[3,1]",
                                                CPU_FP8, *overrides])
    return {r["step"]: r["loss"] for r in rows}, proc.stdout


@pytest.mark.timeout(600)
def test_fp8_and_bf16_groups_train_together_and_checkpoints_resume_in_either_mode(tmp_path, corpus_prefix):
    """A bf16 run saves at step 2; an fp8 run (group 0's 3 layers in fp8, group 1 in bf16,
    across the tcp boundary) resumes it to step 4 and saves; a bf16 run resumes that to step 6.
    Both resumed stretches track the uninterrupted bf16 run, the fp8 one not bit for bit."""
    bf16, _ = _train(tmp_path, "bf16", corpus_prefix, "train.precision=bf16", "train.train_iters=6",
                     "checkpoint.save_interval=2", "checkpoint.keep_last=0",
                     f"checkpoint.save_dir={tmp_path / 'ckpt_bf16'}")
    fp8, out = _train(tmp_path, "fp8", corpus_prefix, "train.precision=fp8", "cluster.groups.1.precision=bf16",
                      "train.train_iters=4", "checkpoint.save_interval=4",
                      f"checkpoint.resume={tmp_path / 'ckpt_bf16' / 'iter_0000002'}",
                      f"checkpoint.save_dir={tmp_path / 'ckpt_fp8'}")
    assert ", fp8," in out and "resumed from" in out
    assert fp8[4] != bf16[4]  # the FP8 GEMMs really ran
    assert fp8[4] == pytest.approx(bf16[4], rel=0.03)
    back, out = _train(tmp_path, "fp8_as_bf16", corpus_prefix, "train.precision=bf16", "train.train_iters=6",
                       f"checkpoint.resume={tmp_path / 'ckpt_fp8' / 'iter_0000004'}")
    assert "resumed from" in out
    assert back[6] == pytest.approx(bf16[6], rel=0.03)


def test_fp8_under_tp_converts_the_shards_and_tracks_the_unsharded_run(tmp_path, corpus_prefix):
    """TP2's ranks scale their own shards (the TP collectives sit outside the linears), which
    is correct but not TP1's arithmetic: the losses agree to FP8 rounding, not bit for bit."""
    runs = {}
    for tp in (1, 2):
        proc, rows = run_pretrain(tmp_path / f"tp{tp}", [*COMMON, f"data.path={corpus_prefix}", CPU_FP8,
                                                         "cluster=cpu_homogeneous", f"partition.tp={tp}",
                                                         f"partition.dp={2 // tp}", "train.precision=fp8",
                                                         "model.num_layers=2", "train.train_iters=4"])
        assert f"TP{tp} x DP{2 // tp}" in proc.stdout and ", fp8," in proc.stdout
        runs[tp] = [r["loss"] for r in rows]
    assert runs[2] == pytest.approx(runs[1], rel=2e-3)
