"""Activation recomputation: same losses and gradients bit for bit, less kept,
per stage in pipelined runs, and chosen by the planner where memory is short."""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import yaml
from conftest import run_cli, run_pretrain
from multiproc import CTX, collect

from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.parallelize import parallelize_tensor
from hetpipe.models.recompute import set_recompute
from hetpipe.parallel.tp_shards import finalize_tensor_parallel_grads
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.profile import saved_tensor_bytes, weight_storages
from hetpipe.partitioner.resolve import resolve_plan
from hetpipe.models.precision import Bf16Weights, cast_parameters, compute_context, fuse_linear_grads
from hetpipe.schema.pretrain_config import resolve

pytestmark = pytest.mark.timeout(300)

MODES = [("selective", None), ("full", None), ("full", 1)]
CFG = model_preset("tiny_llama", num_layers=3)
BATCH, SEQ = 2, 32


def _step(chunk, first: bool, last: bool, precision: str = "fp32") -> tuple:
    """Two microbatches of forward + backward, accumulated: (losses or outputs,
    input gradients, parameter gradients, bytes kept for the backward, RNG state changed)."""
    weights = Bf16Weights([chunk], fuse_linear_grads=True) if precision == "bf16" else None
    if precision == "bf16-pure":  # the trainer's way: bf16 parameters, fused weight gradients
        cast_parameters([chunk], torch.bfloat16)
        fuse_linear_grads([chunk])
    gen = torch.Generator().manual_seed(0)
    outs, input_grads, kept = [], [], 0
    rng = torch.get_rng_state()
    for _ in range(2):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)
        # The residual stream's dtype: bf16 in bf16 mode (hetpipe.models.precision).
        dtype = torch.bfloat16 if precision in ("bf16", "bf16-pure") else torch.float32
        hidden = torch.randn(BATCH, SEQ, CFG.hidden_size, generator=gen).to(dtype).requires_grad_()
        x = tokens if first else hidden
        storages = weight_storages(chunk, weights)
        with compute_context(precision, "cpu", weights, 0), saved_tensor_bytes(storages) as saved:
            out = chunk(x, tokens) if last else chunk(x)
        kept = sum(saved.values())
        if last:
            (out / 2).backward()
        else:
            out.backward(torch.ones_like(out))
        outs.append(out.detach())
        input_grads.append(None if first else hidden.grad)
    grads = {n: p.grad for n, p in chunk.named_parameters()}
    return outs, input_grads, grads, kept, not torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
@pytest.mark.parametrize("units", [None, (1, 4)], ids=["whole", "middle"])
def test_every_mode_gives_the_same_losses_and_gradients_bitwise(units, precision, one_thread):
    first, last = units is None, units is None

    def run(mode, num_layers=None):
        chunk = build_model(CFG, seed=3, units=units)
        set_recompute(chunk, mode, num_layers)
        return _step(chunk, first, last, precision)

    outs, input_grads, grads, kept, rng_moved = run("none")
    assert not rng_moved
    kept_by_mode = {}
    for mode, n in MODES:
        m_outs, m_input_grads, m_grads, m_kept, m_rng_moved = run(mode, n)
        assert all(torch.equal(a, b) for a, b in zip(outs, m_outs)), (mode, n)
        if not first:
            assert all(torch.equal(a, b) for a, b in zip(input_grads, m_input_grads)), (mode, n)
        assert grads.keys() == m_grads.keys()
        assert [k for k in grads if not torch.equal(grads[k], m_grads[k])] == [], (mode, n)
        assert not m_rng_moved  # no RNG stream advances (the rerun runs under the stashed state)
        kept_by_mode[(mode, n)] = m_kept
    # Selective frees exactly SDPA's log-sum-exp (fp32, per head and token) in
    # each layer; full keeps a fraction, more of it with fewer layers covered.
    layers = CFG.num_layers
    assert kept - kept_by_mode[("selective", None)] == layers * 4 * BATCH * CFG.num_attention_heads * SEQ
    assert kept_by_mode[("full", None)] < kept_by_mode[("full", 1)] < kept
    assert kept_by_mode[("full", None)] < kept / 4


TP = 2


def _tp_rank(rank: int, init_file: str, queue) -> None:
    """Each mode of a TP=2 (+SP) chunk against the same chunk without recomputation."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
        cfg = model_preset("tiny_llama", num_layers=2, hidden_size=64, ffn_hidden_size=96)
        same = {}
        for sp in (False, True):
            ref = None
            for mode in ("none", "selective", "full"):
                chunk = parallelize_tensor(build_model(cfg, seed=5), None, TP, rank, sequence_parallel=sp)
                set_recompute(chunk, mode)
                tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
                loss = chunk(tokens, tokens)
                loss.backward()
                finalize_tensor_parallel_grads(chunk)
                got = [loss.detach()] + [p.grad for p in chunk.parameters()]
                ref = ref or got
                same[(mode, sp)] = all(torch.equal(a, b) for a, b in zip(ref, got))
        dist.destroy_process_group()
        queue.put((rank, "ok", same))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def test_tensor_parallel_layers_rerun_their_collectives_bitwise(tmp_path):
    queue = CTX.Queue()
    procs = [CTX.Process(target=_tp_rank, args=(r, str(tmp_path / "store"), queue), daemon=True) for r in range(TP)]
    for rank, same in collect(procs, queue, timeout=240).items():
        assert all(same.values()), (rank, same)


COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.train_iters=6",
          "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=3",
          "optimizer.lr=3e-3", "optimizer.clip_grad=0.5", "cluster.groups.0.device_type=CPU"]


def _train(run_dir, data, *overrides) -> list:
    _, rows = run_pretrain(run_dir, [*COMMON, f"data.path={data}", *overrides])
    return [(r["loss"], r["grad_norm"]) for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix) -> list:
    """One process, no recomputation."""
    return _train(tmp_path_factory.mktemp("ref") / "run", corpus_prefix)


def test_pipelined_run_with_a_mode_per_stage_is_bitwise(tmp_path, corpus_prefix, reference):
    got = _train(tmp_path / "run", corpus_prefix, "cluster=cpu_mixed", "partition.layers=[1,3]",
                 "train.recompute=[selective,full]", "train.recompute_num_layers=[null,2]")
    assert got == reference
    stages = Plan.load(tmp_path / "run" / "plan.yaml").stages
    assert [(s.recompute, s.recompute_num_layers) for s in stages] == [("selective", None), ("full", 2)]


def test_plan_auto_recomputes_on_the_small_memory_group_only_and_runs(tmp_path, corpus_prefix, reference):
    # 3.2 MiB per "amd" CPU rank (x 0.9 headroom): its stage, two layers and
    # the head, fits only with one of its layers recomputed; "nvidia" keeps 24 GB.
    got = _train(tmp_path / "run", corpus_prefix, "cluster=cpu_mixed", "plan=auto",
                 "+planner.memory_gib.amd=0.0032", "planner.group_order=[nvidia,amd]", "planner.schedule=1f1b")
    assert got == reference
    plan = Plan.load(tmp_path / "run" / "plan.yaml")
    assert [(s.group, s.layers, s.recompute, s.recompute_num_layers) for s in plan.stages] == \
        [("nvidia", 2, "none", None), ("amd", 2, "full", 1)]


def test_planner_recomputes_only_on_the_small_memory_group(tmp_path):
    """LLaMA-3-8B at 8192 tokens, the seed paper's TP1 PP2 DP8, on 8 A100-40GB
    and 8 MI300X: the A100 stage recomputes (the fewest layers that fit), the
    MI300X stage does not; without recomputation the A100s could hold only 4
    layers and the plan is slower."""
    common = ["+model=llama8b", "cluster=a100_40gb_mi300x_2node", "train.seq_length=8192",
              "train.micro_batch_size=1", "train.global_batch_size=128", "planner.tp=1", "planner.dp=8",
              "planner.stages=[1,1]"]
    plans = {}
    for name, extra in (("auto", []), ("none", ["planner.recompute=none"])):
        proc = run_cli(["-m", "hetpipe.plan", *common, *extra, f"hydra.run.dir={tmp_path / name}"], timeout=120)
        assert proc.returncode == 0, proc.stderr
        plans[name] = Plan.load(tmp_path / name / "plan.yaml")
    by_group = {s.group: s for s in plans["auto"].stages}
    assert by_group["nvidia"].recompute == "full" and by_group["amd"].recompute == "none"
    assert 0 < (by_group["nvidia"].recompute_num_layers or by_group["nvidia"].layers) <= by_group["nvidia"].layers
    assert all(s.recompute == "none" for s in plans["none"].stages)
    assert {s.group: s.layers for s in plans["none"].stages}["nvidia"] < by_group["nvidia"].layers
    assert plans["auto"].notes["predicted_step_s"] < plans["none"].notes["predicted_step_s"]


def _config(**fields) -> dict:
    cfg = {"model": {"name": "tiny_llama", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                     "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512,
                     "max_position_embeddings": 128},
           "cluster": {"name": "cpu_mixed", "emulate": True,
                       "groups": [{"name": "nvidia", "device_type": "CPU"}, {"name": "amd", "device_type": "CPU"}]}}
    for key, value in fields.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return cfg


@pytest.mark.parametrize("fields, message", [
    (dict(train__recompute="sometimes"), r"train.recompute='sometimes': 'sometimes' is not one of none, selective"),
    (dict(train__recompute_num_layers=-1), r"train.recompute_num_layers=-1: -1 is not a layer count"),
    (dict(train__recompute=["full", "none"], train__recompute_num_layers=[1]), "list different numbers of stages"),
    (dict(train__recompute=["full", "none", "none"]), r"has 3 entries but the plan has 2 \(virtual\) stages"),
    (dict(train__recompute="full", top__plan="auto"), "plan=auto brings its own recomputation per stage"),
    (dict(train__recompute="full", train__compile=True), r"stage\(s\) \[0, 1\] recompute .* train.compile=true"),
    (dict(planner__recompute="sometimes"), "planner.recompute='sometimes' is not one of auto, none, selective"),
    (dict(planner__memory_gib={"intel": 1.0}, top__plan="auto"), r"planner.memory_gib names \['intel'\]"),
])
def test_bad_settings_are_one_clear_error(fields, message):
    cfg = _config(**{k: v for k, v in fields.items() if not k.startswith("top__")})
    cfg.update({k[len("top__"):]: v for k, v in fields.items() if k.startswith("top__")})
    with pytest.raises(ConfigError, match=message) as err:
        resolve_plan(resolve(cfg))
    assert "\n" not in str(err.value)


def test_a_bad_setting_ends_the_cli_in_one_line(tmp_path, corpus_prefix):
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "cluster=cpu_mixed",
                    "train.recompute=[full]", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hetpipe: error: train.recompute=['full'] has 1 entries but the plan has 2 (virtual) stages (layers [2, 2])"]


def test_plans_written_before_per_stage_recomputation_still_load():
    old = {"stages": [{"group": "g", "ranks": [0], "layers": 2}], "schedule": "1f1b", "num_chunks": 1,
           "recompute": False, "notes": {}}
    plan = Plan.from_dict(yaml.safe_load(yaml.safe_dump(old)))
    assert plan.stages[0].recompute == "none"
