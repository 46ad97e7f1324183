"""Data parallelism (hetpipe.parallel.grad_reducer, hetpipe.parallel.zero1) against the single-process run.

Two real gloo ranks (spawned processes, FileStore in tmp_path) each run half
of every global batch; the single-process reference runs all of it in each
worker, so every comparison happens inside the ranks and only a short report
comes back.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from multiproc import CTX, collect

from hetpipe.models import ModelConfig, build_model
from hetpipe.parallel.grad_reducer import GradReducer
from hetpipe.parallel.zero1 import DistributedOptimizer

WORLD = 2
GLOBAL_MICRO = 8          # microbatches per global batch; each rank runs 4
LOCAL_MICRO = GLOBAL_MICRO // WORLD
BUCKET_BYTES = 96 * 1024  # several buckets for the ~650 kB tiny model
SEED = 3
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


# -- harness -----------------------------------------------------------------


def _child(target, rank: int, init_file: str, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        try:
            results.put((rank, "ok", target(rank)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(target, tmp_path, timeout: float = 90.0) -> dict[int, dict]:
    results = CTX.Queue()
    procs = [CTX.Process(target=_child, args=(target, r, str(tmp_path / "store"), results), daemon=True)
             for r in range(WORLD)]
    return collect(procs, results, timeout)


# -- the model and data ------------------------------------------------------


def _cfg() -> ModelConfig:
    return ModelConfig(hidden_size=64, num_layers=2)


def _batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of ``step``: GLOBAL_MICRO (tokens, labels) microbatches."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, _cfg().vocab_size, (GLOBAL_MICRO, 2, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _local(batch, rank: int):
    return batch[rank * LOCAL_MICRO:(rank + 1) * LOCAL_MICRO]


def _forward_backward(model, microbatches) -> torch.Tensor:
    """Sum of the microbatch losses; each backward scaled by 1/len (the engine's scaling)."""
    total = torch.zeros(())
    for tokens, labels in microbatches:
        loss = model(tokens, labels)
        (loss / len(microbatches)).backward()
        total += loss.detach()
    return total


def _groups(model, named: bool = False) -> list[dict]:
    """build_optimizer's two groups: matrices decayed, vectors not."""
    items = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    pick = (lambda n, p: (n, p)) if named else (lambda n, p: p)
    return [{"params": [pick(n, p) for n, p in items if p.ndim >= 2], "weight_decay": WD},
            {"params": [pick(n, p) for n, p in items if p.ndim < 2], "weight_decay": 0.0}]


def _adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(_groups(model), lr=LR, betas=BETAS, eps=EPS, fused=False)


def _lr(step: int) -> float:
    return LR * (step + 1) / 10  # changes every step: the optimizer must follow param_groups


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _max_rel_params(model, ref) -> float:
    ref_params = dict(ref.named_parameters())
    return max(_rel(p.detach(), ref_params[n].detach()) for n, p in model.named_parameters())


def _reference_run(steps: range, model=None, opt=None) -> tuple[list[float], torch.nn.Module]:
    """Single-process AdamW over whole global batches; returns (mean losses, model)."""
    model = model if model is not None else build_model(_cfg(), seed=SEED)
    opt = opt if opt is not None else _adamw(model)
    losses = []
    for step in steps:
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        total = _forward_backward(model, _batch(step))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total) / GLOBAL_MICRO)
    return losses, model


def _dp_step(model, reducer, opt, step: int, rank: int, zero) -> float:
    """One data-parallel step on this rank's half of the batch; returns the global mean loss."""
    for g in opt.param_groups:
        g["lr"] = _lr(step)
    total = _forward_backward(model, _local(_batch(step), rank))
    reducer.finish()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after finish(): the averaged grads
    opt.step()
    zero()
    dist.all_reduce(total)
    return float(total) / GLOBAL_MICRO


# -- GradReducer -------------------------------------------------------------


def _reducer_worker(rank: int) -> dict:
    report: dict = {}
    # Gradients of one step against the whole batch in one process.
    ref = build_model(_cfg(), seed=SEED)
    _forward_backward(ref, _batch(0))
    model = build_model(_cfg(), seed=SEED)
    reducer = GradReducer([model], None, bucket_bytes=BUCKET_BYTES, microbatches_per_step=LOCAL_MICRO)
    _forward_backward(model, _local(_batch(0), rank))
    events_before_finish = list(reducer.events)
    reducer.finish()
    ref_grads = dict(ref.named_parameters())
    report["grad_rel"] = max(_rel(p.grad, ref_grads[n].grad) for n, p in model.named_parameters())
    report["num_buckets"] = reducer.num_buckets
    report["collectives"] = [reducer.num_collectives_last_step]
    events = reducer.last_step_events
    grads = [i for i, (kind, _) in enumerate(events) if kind == "grad"]
    launches = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    report["grad_events"] = len(grads)
    report["launched_during_backward"] = sum(1 for e in events_before_finish if e[0] == "launch")
    report["first_launch_before_last_grad"] = bool(launches) and launches[0] < grads[-1]
    report["launch_order"] = [b for kind, b in events if kind == "launch"]

    # Ten AdamW steps (the first one again from fresh weights), zero_grad(set_to_none=True).
    ref_losses, ref_model = _reference_run(range(10))
    model = build_model(_cfg(), seed=SEED)
    reducer = GradReducer([model], None, bucket_bytes=BUCKET_BYTES, microbatches_per_step=LOCAL_MICRO)
    opt = _adamw(model)
    losses = []
    for step in range(10):
        losses.append(_dp_step(model, reducer, opt, step, rank, lambda: opt.zero_grad(set_to_none=True)))
        report["collectives"].append(reducer.num_collectives_last_step)
    report["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    report["param_rel"] = _max_rel_params(model, ref_model)
    return report


def test_grad_reducer_matches_single_process_and_overlaps(tmp_path):
    reports = run_ranks(_reducer_worker, tmp_path)
    for rank, r in reports.items():
        assert r["grad_rel"] < 1e-6, (rank, r["grad_rel"])
        assert r["loss_rel"] < 1e-6, (rank, r["loss_rel"])
        assert r["param_rel"] < 1e-6, (rank, r["param_rel"])
        # 4 microbatches accumulated: one all-reduce per bucket per step, not four.
        assert r["num_buckets"] >= 3
        assert r["collectives"] == [r["num_buckets"]] * 11, r["collectives"]
        assert r["grad_events"] == LOCAL_MICRO * len(list(build_model(_cfg(), seed=0).parameters()))
        # Launched from the hooks while backward still ran, in bucket order.
        assert r["launched_during_backward"] >= 1
        assert r["first_launch_before_last_grad"]
        assert r["launch_order"] == list(range(r["num_buckets"]))
    assert reports[0]["launch_order"] == reports[1]["launch_order"]


def _unused_param_worker(rank: int) -> dict:
    """A parameter without gradient (on one rank only) counts as zeros; the
    bucket holding it is reduced at finish(), with the same collectives everywhere."""
    lin = torch.nn.Linear(4, 4)
    extra = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    for p in [*lin.parameters(), *extra.parameters()]:
        torch.nn.init.normal_(p)
    reducer = GradReducer([lin, extra], None, bucket_bytes=64, microbatches_per_step=2)
    x = torch.ones(3, 4) * (rank + 1)
    for _ in range(2):
        out = lin(x).sum()
        if rank == 1:
            out = out + extra(x).sum()
        out.backward()
    reducer.finish()
    # Rank 1 only: two backward passes over 3 rows of x=2, averaged over the two ranks.
    return {"extra_bias_grad": extra.bias.grad.tolist(), "extra_weight_grad": extra.weight.grad.unique().tolist(),
            "collectives": reducer.num_collectives_last_step, "buckets": reducer.num_buckets}


def test_grad_reducer_missing_gradients_are_zeros(tmp_path):
    reports = run_ranks(_unused_param_worker, tmp_path)
    for r in reports.values():
        assert r["extra_bias_grad"] == [2 * 3 / 2] * 4
        assert r["extra_weight_grad"] == [2 * 3 * 2 / 2]
        assert r["collectives"] == r["buckets"]


# -- DistributedOptimizer ----------------------------------------------------


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def _distopt_worker(rank: int) -> dict:
    report: dict = {}
    ref_losses, ref_model = _reference_run(range(10))
    ref5 = build_model(_cfg(), seed=SEED)
    ref5_opt = _adamw(ref5)
    _reference_run(range(5), ref5, ref5_opt)

    def make(params_from=None):
        model = build_model(_cfg(), seed=SEED)
        if params_from is not None:
            model.load_state_dict(params_from)
        reducer = GradReducer([model], None, bucket_bytes=BUCKET_BYTES, microbatches_per_step=LOCAL_MICRO)
        opt = DistributedOptimizer(_groups(model, named=True), None, lr=LR, betas=BETAS, eps=EPS)
        return model, reducer, opt

    model, reducer, opt = make()
    losses = [_dp_step(model, reducer, opt, s, rank, reducer.zero_grad) for s in range(5)]
    report["state_bytes"] = opt.state_bytes()
    report["plain_state_bytes"] = _state_bytes(ref5_opt)
    weights5 = {k: v.clone() for k, v in model.state_dict().items()}
    full = opt.full_state_dict()
    sharded = opt.sharded_state_dict()
    # The gathered state is plain AdamW's after the same five steps.
    names = {id(p): n for n, p in ref5.named_parameters()}
    report["full_state_rel"] = max(
        _rel(full[names[id(p)]][k], st[k]) for p, st in ref5_opt.state.items() for k in ("exp_avg", "exp_avg_sq"))
    report["full_steps"] = sorted({float(v["step"]) for v in full.values()})
    losses += [_dp_step(model, reducer, opt, s, rank, reducer.zero_grad) for s in range(5, 10)]
    report["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    report["param_rel"] = _max_rel_params(model, ref_model)

    # Resume at DP=2 from the full state, and from this rank's sharded state.
    for kind in ("full", "sharded"):
        model2, reducer2, opt2 = make(weights5)
        if kind == "full":
            opt2.load_full_state_dict(full)
        else:
            opt2.load_sharded_state_dict(sharded)
        resumed = [_dp_step(model2, reducer2, opt2, s, rank, reducer2.zero_grad) for s in range(5, 10)]
        report[f"resume_{kind}_loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(resumed, losses[5:]))
        report[f"resume_{kind}_param_rel"] = _max_rel_params(model2, model)

    # Resume a plain single-process AdamW from the gathered per-name state.
    plain = build_model(_cfg(), seed=SEED)
    plain.load_state_dict(weights5)
    plain_opt = _adamw(plain)
    for n, p in plain.named_parameters():
        plain_opt.state[p] = {k: v.clone() for k, v in full[n].items()}
    plain_losses, _ = _reference_run(range(5, 10), plain, plain_opt)
    report["plain_resume_loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(plain_losses, ref_losses[5:]))
    report["plain_resume_param_rel"] = _max_rel_params(plain, ref_model)

    # Resharding: one rank alone (DP=1) assembles its state from both ranks' shards.
    singles = [dist.new_group([r]) for r in range(WORLD)]
    every = [None] * WORLD
    dist.all_gather_object(every, sharded)
    alone = build_model(_cfg(), seed=SEED)
    alone.load_state_dict(weights5)
    alone_opt = DistributedOptimizer(_groups(alone, named=True), singles[rank], lr=LR, betas=BETAS, eps=EPS)
    alone_opt.load_sharded_state_dict(every)
    alone_full = alone_opt.full_state_dict()
    report["reshard_rel"] = max(_rel(alone_full[n][k], full[n][k]) for n in full for k in ("exp_avg", "exp_avg_sq"))
    report["reshard_state_bytes"] = alone_opt.state_bytes()

    report["bf16"] = _bf16_check(rank)
    return report


def _bf16_check(rank: int) -> float:
    """bf16 parameters: the fp32 main copies follow fp32 AdamW exactly."""
    g = torch.Generator().manual_seed(5)
    masters = [torch.randn(37, generator=g), torch.randn(5, 6, generator=g)]  # 67 elements: padded
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = DistributedOptimizer([{"params": [params[0]], "weight_decay": 0.0},
                                {"params": [params[1]], "weight_decay": WD}], None, lr=LR, betas=BETAS, eps=EPS)
    ref = torch.optim.AdamW([{"params": [masters[0]], "weight_decay": 0.0},
                             {"params": [masters[1]], "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS,
                            fused=False)
    for _ in range(3):
        for p, m in zip(params, masters):
            grad = torch.randn(p.shape, generator=g)
            p.grad, m.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        opt.step()
        ref.step()
    return max(float((p.detach().float() - m.detach().to(torch.bfloat16).float()).abs().max())
               for p, m in zip(params, masters))


def test_distributed_optimizer_matches_adamw_and_shards_state(tmp_path):
    reports = run_ranks(_distopt_worker, tmp_path)
    total = sum(r["state_bytes"] for r in reports.values())
    for rank, r in reports.items():
        assert r["loss_rel"] < 1e-6, (rank, r["loss_rel"])
        assert r["param_rel"] < 1e-6, (rank, r["param_rel"])
        # Optimizer state per rank shrinks by the DP degree (up to padding and step counters).
        ratio = r["state_bytes"] / r["plain_state_bytes"]
        assert ratio <= 1 / WORLD + 0.01, (rank, ratio)
        assert r["full_state_rel"] < 1e-5, (rank, r["full_state_rel"])
        assert r["full_steps"] == [5.0]
        for kind in ("full", "sharded"):
            assert r[f"resume_{kind}_loss_rel"] == 0.0, (rank, kind)
            assert r[f"resume_{kind}_param_rel"] == 0.0, (rank, kind)
        assert r["plain_resume_loss_rel"] < 1e-6, (rank, r["plain_resume_loss_rel"])
        assert r["plain_resume_param_rel"] < 1e-6, (rank, r["plain_resume_param_rel"])
        assert r["reshard_rel"] == 0.0
        assert r["reshard_state_bytes"] >= 0.99 * total
        assert r["bf16"] == 0.0
    assert abs(total - reports[0]["plain_state_bytes"]) <= 0.01 * reports[0]["plain_state_bytes"]


def test_distributed_optimizer_single_process_is_adamw(one_thread):
    """Without a process group it is plain AdamW (and refuses the per-parameter state API)."""
    ref_losses, ref_model = _reference_run(range(3))
    model = build_model(_cfg(), seed=SEED)
    opt = DistributedOptimizer(_groups(model), lr=LR, betas=BETAS, eps=EPS)
    losses, _ = _reference_run(range(3), model, opt)
    assert losses == ref_losses
    assert _max_rel_params(model, ref_model) == 0.0
    assert set(opt.full_state_dict()) == {f"param{i}" for i in range(len(list(model.parameters())))}
    with pytest.raises(TypeError, match="sharded"):
        opt.state.get(next(model.parameters()), {})
    with pytest.raises(TypeError, match="sharded"):
        opt.state_dict()
