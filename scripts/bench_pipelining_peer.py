#!/usr/bin/env python
"""Peer reference for the two-GPU benchmark: the same model, weights, data and
optimizer as ``python -m hetpipe.pretrain``, pipelined by PyTorch's own
``torch.distributed.pipelining`` (``PipelineStage`` + one of its schedules).

``--schedule`` picks the schedule; all but the last two run one stage
module per GPU (the peer's split is hetpipe's):

  1f1b              Schedule1F1B (the default)
  gpipe             ScheduleGPipe
  interleaved_1f1b  ScheduleInterleaved1F1B with one local stage (1F1B through
                    the multi-stage runtime)
  looped_bfs        ScheduleLoopedBFS with one local stage (GPipe's order)
  interleaved_zb    ScheduleInterleavedZeroBubble with one local stage: the
                    backward split into input and weight gradients, the
                    latter filling the bubbles (ZB-H1 at PP2, hetpipe's zb_h1)

  zbv               ScheduleZBVZeroBubble: two stage modules per rank in a V
                    (stages 0 and 3 on rank 0, 1 and 2 on rank 1; hetpipe's zb_v)
  dualpipev         ScheduleDualPipeV: the same V, DualPipe's order (one
                    chunk's forward beside the other's backward)

For the two V schedules ``--layers`` takes four counts (virtual stages 0..3
in pipeline order), or two per-rank counts that are halved into the V
(17,15 -> 9,8,7,8: rank 0 keeps 17 layers, rank 1 15); rank 0 holds the
embedding and the head, so a tied embedding's two gradients add there.

The script starts its two ranks itself, forked from one server that imported
it once (NCCL with one GPU per rank on ``--device cuda``, gloo on ``--device
cpu``). Rank r builds stage r exactly as
our trainer does: ``build_model(cfg, seed, units=plan.unit_ranges()[r])``, so
the same seed gives the same weights, and reads the same microbatches from the
same :class:`MicrobatchLoader`. The optimizer is our ``build_optimizer`` (fused
AdamW, no decay on norms/biases) driven by our ``lr_at`` schedule, with
optional global-norm clipping (``--opt clip_grad=...``; the optimizer
defaults, clipping at 1.0 included, are ``hetpipe.pretrain``'s).

Where the output head sits (the peer's known weakness at a 128K vocabulary):

* default: the head is inside the last stage module, which returns the logits
  [mb, seq, V] (bf16 under autocast); ``loss_fn`` is fp32 cross-entropy on them.
  With PyTorch's default ``return_outputs=True`` the schedule keeps every
  microbatch's logits until the step ends (``--no-return-outputs`` drops them
  where the installed torch supports it).
* ``--head-in-loss``: the last stage module returns the hidden states and the
  head's norm + projection + cross-entropy run inside ``loss_fn`` (the head's
  weights stay parameters of the stage module, so they are optimised and
  scaled like the rest); one microbatch's logits live only until its backward.
  ``--fused-ce`` additionally uses hetpipe's chunked fused cross-entropy there.

Precision: on GPU fp32 master weights with bf16 autocast around each stage
forward and the loss (the forward only, as our engine does), or
``--bf16-weights`` for bf16 parameters with no autocast; fp32 on CPU.
``--fp8 RECIPE`` converts the decoder layers' linears (those torchao's
alignment admits, as hetpipe's fp8 does) to torchao Float8Linear, torchao's
own way, with its FP8 dtypes for this process's device, on the same fp32
master weights under autocast: torchtitan's ``quantize.linear.float8``
without FSDP.

Output: one JSON line per step on stdout (loss from the last stage, step time,
tokens/s, TFLOP/s per GPU by Megatron's formula, peak memory per rank), a
summary line over the steps after ``--warmup``, and ``--out`` as
``{"name": "pipelining_<schedule>", "status": "ok"|"oom", "tokens_per_s",
"tflops_per_gpu", "peak_mem_gib": [r0, r1], "losses": [...], ...}``. A CUDA
out-of-memory on either rank is a result (``"status": "oom"``, with the rank,
step and message), not a crash.

The options and the split are ``scripts/peer_options.py``, the stage modules
and gradient handling ``scripts/peer_stages.py``; this file spawns the ranks,
runs one rank's steps and writes the result.

Example (2 GPUs)::

    python scripts/bench_pipelining_peer.py --model llama8b --layers 17,15 \\
        --seq-length 8192 --micro-batch-size 1 --microbatches 32 --steps 3 --warmup 1 \\
        --data demo --device cuda --out peer.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import pipelining

from hetpipe.data import MicrobatchLoader, demo_corpus
from hetpipe.models import build_model
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.fp8 import convert_to_fp8, torchao_fp8_format
from hetpipe.training.determinism import seed_everything
from hetpipe.training.rank_setup import build_optimizer
from hetpipe.training.trainer import lr_at

# Its options and stage modules sit beside this script (sys.path[0] when run as a script).
from peer_options import (  # noqa: E402
    MULTI_STAGE, NUM_RANKS, SCHEDULES, local_stages, make_plan, model_config, num_stages, optimizer_config,
    parse_args)
from peer_stages import PeerStage, clip_global_norm, make_loss_fn, sync_tied, warm_up  # noqa: E402

GIB = 2**30


# --------------------------------------------------------------------------- one rank

def _is_oom(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def run_rank(rank: int, opts: argparse.Namespace, port: int, workdir: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if opts.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // NUM_RANKS))
    dist.init_process_group(backend, rank=rank, world_size=NUM_RANKS,
                            timeout=timedelta(minutes=opts.timeout_min))
    try:
        _train(rank, opts, device, workdir)
    except BaseException as exc:  # noqa: BLE001 - an OOM is a result, anything else re-raised
        if _is_oom(exc):
            record = {"rank": rank, "error": str(exc).strip().splitlines()[0][:500],
                      "peak_mem_gib": _peak_gib(device)}
            cause = exc
            while cause is not None and not isinstance(cause, torch.cuda.OutOfMemoryError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                record["error"] = str(cause).strip().splitlines()[0][:500]
            step_file = Path(workdir) / f"progress_rank{rank}"
            record["step"] = int(step_file.read_text()) if step_file.is_file() else 0  # 0: before step 1
            (Path(workdir) / f"oom_rank{rank}.json").write_text(json.dumps(record))
            print(f"bench_pipelining_peer: rank {rank} ran out of memory: {record['error']}",
                  file=sys.stderr, flush=True)
            # The other rank is blocked on this one; the parent ends it. Skip
            # the NCCL teardown, which would wait for it.
            os._exit(3)
        raise
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on CPU (gloo) a C++ destructor
    # at exit occasionally aborted a rank ("terminate called without an active
    # exception") after every step and result had been written, failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(rank: int, opts: argparse.Namespace, device: torch.device, workdir: str) -> None:
    cfg = model_config(opts)
    opt_cfg = optimizer_config(opts)
    plan = make_plan(opts.layers, cfg.num_layers, opts.schedule)
    stages_total = num_stages(opts.schedule)
    held = local_stages(opts.schedule, rank)
    seed_everything(opts.seed)
    chunks = [build_model(cfg, seed=opts.seed, units=plan.unit_ranges()[v], device=device) for v in held]
    act_dtype = torch.float32
    for chunk in chunks:
        if opts.fp8:
            convert_to_fp8([chunk], opts.fp8, torchao_fp8_format())
        if opts.bf16_weights:
            inv_freq = chunk.inv_freq
            chunk.to(torch.bfloat16)
            chunk.inv_freq = inv_freq  # RoPE frequencies stay fp32, as in our model
            act_dtype = torch.bfloat16
        if opts.compile:
            for layer in chunk.layers.values():
                layer.compile()
    amp = "cuda" if (device.type == "cuda" and not opts.bf16_weights) else None
    modules = [PeerStage(chunk, amp, opts.head_in_loss) for chunk in chunks]
    fake = os.environ.get("BENCH_PEER_FAKE_OOM")
    if fake and int(fake.split(",")[0]) == rank:
        modules[0].fake_oom_step = int(fake.split(",")[1])
    holds_last = stages_total - 1 in held
    loss_rank = next(r for r in range(NUM_RANKS) if stages_total - 1 in local_stages(opts.schedule, r))
    loss_fn = make_loss_fn(modules[held.index(stages_total - 1)] if holds_last else modules[0], opts.fused_ce)

    global_batch = opts.micro_batch_size * opts.microbatches
    loader = MicrobatchLoader(opts.data, opts.tokenizer, seq_length=opts.seq_length,
                              global_batch_size=global_batch, micro_batch_size=opts.micro_batch_size,
                              vocab_size=cfg.vocab_size, seed=opts.seed)
    assert loader.num_microbatches == opts.microbatches
    optimizer = build_optimizer(chunks, opt_cfg, device)

    metas = {v: warm_up(m, loss_fn, v == 0, opts, cfg, device, act_dtype) for v, m in zip(held, modules)}
    # The boundary buffers are allocated from these metas: a dtype or shape
    # mismatch would be garbage on the wire, so check it once, loudly.
    gathered = [None] * NUM_RANKS
    dist.all_gather_object(gathered, {v: ((tuple(i.shape), str(i.dtype)), (tuple(o.shape), str(o.dtype)))
                                      for v, (i, o) in metas.items()})
    described = {v: io for part in gathered for v, io in part.items()}
    for v in range(stages_total - 1):
        if described[v][1] != described[v + 1][0]:
            raise RuntimeError(f"stage {v} sends {described[v][1]} but stage {v + 1} expects {described[v + 1][0]}")
    stages = [pipelining.PipelineStage(m, stage_index=v, num_stages=stages_total, device=device,
                                       input_args=metas[v][0], output_args=metas[v][1])
              for v, m in zip(held, modules)]
    schedule_class = getattr(pipelining, SCHEDULES[opts.schedule])
    schedule = schedule_class(stages if opts.schedule in MULTI_STAGE else stages[0],
                              n_microbatches=opts.microbatches, loss_fn=loss_fn)
    step_kwargs = {}
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        step_kwargs["return_outputs"] = opts.return_outputs
    elif not opts.return_outputs and holds_last:
        print("bench_pipelining_peer: this torch's schedule.step has no return_outputs; outputs are kept",
              file=sys.stderr, flush=True)
    flops = megatron_model_flops(cfg, global_batch, opts.seq_length)
    tokens_per_step = global_batch * opts.seq_length
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    if rank == 0:
        precision = summary_precision(opts).replace("-", " ")
        head = "in the last stage"
        if opts.head_in_loss:
            head = "in loss_fn" + (" (fused CE)" if opts.fused_ce else "")
        print(f"bench_pipelining_peer: {cfg.name} ({cfg.num_parameters() / 1e6:.1f}M parameters), layers "
              f"{[s.layers for s in plan.stages]}, {SCHEDULES[opts.schedule]} over {opts.microbatches} microbatches of "
              f"{opts.micro_batch_size}x{opts.seq_length}, {precision}, head {head}, "
              f"return_outputs={opts.return_outputs}, torch {torch.__version__}, {device.type}", flush=True)

    for step in range(opts.steps):
        (Path(workdir) / f"progress_rank{rank}").write_text(str(step + 1))
        for module in modules:
            module.step = step + 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        lr = lr_at(step, opt_cfg, opts.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        microbatches = loader.next_step()
        losses: list[torch.Tensor] = []
        args, kwargs = [], dict(step_kwargs)
        if 0 in held:
            args.append(torch.cat([t for t, _ in microbatches]).to(device, non_blocking=True))
        if holds_last:
            kwargs.update(target=torch.cat([y for _, y in microbatches]).to(device, non_blocking=True),
                          losses=losses)
        schedule.step(*args, **kwargs)
        sync_tied(chunks)
        grad_norm = clip_global_norm(chunks, opt_cfg.clip_grad, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start

        loss = float("nan")
        if holds_last:
            total = None
            for x in losses:  # microbatch order, as our engine sums them
                total = x.detach().float() if total is None else total + x.detach().float()
            loss = (total / opts.microbatches).item()
        peak = _peak_gib(device)
        mine = torch.tensor([loss, elapsed, -1.0 if peak is None else peak], dtype=torch.float64, device=device)
        table = [torch.empty_like(mine) for _ in range(NUM_RANKS)]
        dist.all_gather(table, mine)
        if rank == 0:
            rows = [t.tolist() for t in table]
            step_time = max(r[1] for r in rows)
            record = {
                "step": step + 1,
                "loss": rows[loss_rank][0],
                "grad_norm": float(grad_norm),
                "lr": lr,
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time,
                "tflops_per_gpu": flops / step_time / NUM_RANKS / 1e12,
                "peak_mem_gib": [None if r[2] < 0 else r[2] for r in rows],
                "warmup": step < opts.warmup,
            }
            print(json.dumps(record), flush=True)
            with open(Path(workdir) / "steps.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------- driver

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary_precision(opts: argparse.Namespace) -> str:
    """The peer's precision as its result names it."""
    base = "bf16-weights" if opts.bf16_weights else "bf16-autocast" if opts.device == "cuda" else "fp32"
    return f"fp8-{opts.fp8}+{base}" if opts.fp8 else base


def summarise(opts: argparse.Namespace, cfg, plan, records: list[dict], oom: Optional[dict]) -> dict:
    measured = [r for r in records if not r["warmup"]]
    result: dict[str, Any] = {
        "name": f"pipelining_{opts.schedule}",
        "schedule": SCHEDULES[opts.schedule],
        "status": "oom" if oom else "ok",
        "model": cfg.name,
        "model_config": cfg.to_dict(),
        "layers": [s.layers for s in plan.stages],
        "seq_length": opts.seq_length,
        "micro_batch_size": opts.micro_batch_size,
        "microbatches": opts.microbatches,
        "global_batch_size": opts.micro_batch_size * opts.microbatches,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "device": opts.device,
        "precision": summary_precision(opts),
        "head": ("loss_fn-fused" if opts.fused_ce else "loss_fn") if opts.head_in_loss else "last_stage",
        "return_outputs": opts.return_outputs,
        "compile": opts.compile,
        "torch": torch.__version__,
        "tokens_per_s": None,
        "tflops_per_gpu": None,
        "step_time_s": None,
        "peak_mem_gib": records[-1]["peak_mem_gib"] if records else None,
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "steps_detail": records,
    }
    if measured and not oom:
        step_time = sum(r["step_time_s"] for r in measured) / len(measured)
        tokens = opts.micro_batch_size * opts.microbatches * opts.seq_length
        flops = megatron_model_flops(cfg, opts.micro_batch_size * opts.microbatches, opts.seq_length)
        result.update(step_time_s=step_time, tokens_per_s=tokens / step_time,
                      tflops_per_gpu=flops / step_time / NUM_RANKS / 1e12)
    if oom:
        result["oom"] = oom
        result["peak_mem_gib"] = oom.get("peak_mem_gib_per_rank", result["peak_mem_gib"])
    return result


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_args(argv, __doc__.split("\n\n")[0])
    cfg = model_config(opts)
    optimizer_config(opts)
    plan = make_plan(opts.layers, cfg.num_layers, opts.schedule)
    if opts.device == "cuda" and torch.cuda.device_count() < NUM_RANKS:
        raise SystemExit(f"bench_pipelining_peer: needs {NUM_RANKS} GPUs, found {torch.cuda.device_count()}")
    if opts.data == "demo":
        opts.data = demo_corpus(opts.tokenizer)  # built once here, not by both ranks at once
    MicrobatchLoader(opts.data, opts.tokenizer, seq_length=opts.seq_length,
                     global_batch_size=opts.micro_batch_size * opts.microbatches,
                     micro_batch_size=opts.micro_batch_size, vocab_size=cfg.vocab_size, seed=opts.seed)

    with tempfile.TemporaryDirectory(prefix="peer-") as workdir:
        failure: Optional[BaseException] = None
        try:
            # The ranks fork from one server that imported this script (torch, hetpipe) once,
            # as hetpipe.launch's ranks do, instead of two interpreters importing it each.
            mp.set_forkserver_preload(["__main__"])
            mp.start_processes(run_rank, args=(opts, _free_port(), workdir), nprocs=NUM_RANKS, join=True,
                               start_method="forkserver")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failure = exc
        steps_file = Path(workdir) / "steps.jsonl"
        records = [json.loads(line) for line in steps_file.read_text().splitlines()] if steps_file.is_file() else []
        ooms = [json.loads(p.read_text()) for p in sorted(Path(workdir).glob("oom_rank*.json"))]
    oom = None
    if ooms:
        oom = {"rank": ooms[0]["rank"], "step": ooms[0]["step"], "error": ooms[0]["error"],
               "ranks": [o["rank"] for o in ooms],
               "peak_mem_gib_per_rank": [next((o["peak_mem_gib"] for o in ooms if o["rank"] == r), None)
                                         for r in range(NUM_RANKS)]}
    elif failure is not None:
        print(f"bench_pipelining_peer: a rank failed:\n{failure}", file=sys.stderr)
        return 1

    result = summarise(opts, cfg, plan, records, oom)
    summary = {k: result[k] for k in ("name", "status", "tokens_per_s", "tflops_per_gpu", "step_time_s",
                                      "peak_mem_gib")}
    summary["summary"] = True
    if oom:
        summary["oom"] = {k: oom[k] for k in ("rank", "step", "error")}
    print(json.dumps(summary), flush=True)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
