"""How long a checkpoint save stalls training, synchronous against asynchronous.

One process trains a LLaMA-shaped model large enough that its state matters
(default: 53M parameters, 0.64 GB of fp32 weights and AdamW moments) with
fused AdamW, and saves through the trainer's own :class:`CheckpointSaver`
every ``--steps-between`` steps, first with ``checkpoint.async_save=false``,
then with ``true``. Per save it reports the stall - the time the step loop
is blocked in ``save()``: the whole write and commit when synchronous; the
snapshot to host memory (plus any wait for the previous save) when not - and
the background write's duration (safetensors, fsync, sha256, manifest,
rename), and the mean step time with and without a write running beside it,
since on a small CPU the writer competes with training for the cores.
The table comes last.

    python scripts/bench_checkpoint.py [--saves 3] [--steps-between 3] [--dir /tmp/x]
    python scripts/bench_checkpoint.py --device cuda --hidden 4096 --ffn 14336 --layers 2 \
        --vocab 128256 --heads 32 --kv-heads 8 --seq 4096 --batch 1   # LLaMA-3-8B-shaped, one GPU
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetpipe.checkpoint import CheckpointConfig, CheckpointSaver
from hetpipe.models import build_model, model_preset
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.training.rank_setup import build_optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, tokens) -> float:
    _sync(tokens.device)
    started = time.perf_counter()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(tokens.device)
    return time.perf_counter() - started


def _run(cfg, args, root: Path, background: bool) -> dict:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(cfg, seed=1234, device=device)
    opt = build_optimizer([model], OptimizerConfig(lr=1e-4), device)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    _step(model, opt, tokens)  # AdamW's state exists from here on
    saver = CheckpointSaver(CheckpointConfig(save_dir=str(root / ("async" if background else "sync")), keep_last=1,
                                             async_save=background), root, model_cfg=cfg)
    stalls, writes, quiet, beside = [], [], [], []
    step = 1
    for _ in range(args.saves):
        for _ in range(args.steps_between):
            writing = saver.in_flight
            (beside if writing else quiet).append(_step(model, opt, tokens))
            step += 1
        _sync(device)
        started = time.perf_counter()
        saver.save(step, [model], opt, {"consumed_samples": step})
        _sync(device)
        stalls.append(time.perf_counter() - started)
        if not background:
            writes.append(saver.last_timing["write_s"])
    saver.close()
    if background:
        writes = [t["write_s"] for t in saver.timings]
    return {"stall": stalls, "write": writes, "quiet": quiet, "beside": beside,
            "bytes": saver.last_timing["bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU's state (snapshot to pinned host memory)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    cfg = model_preset("tiny_llama", hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_layers=args.layers,
                       vocab_size=args.vocab, num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                       max_position_embeddings=max(args.seq, 128))
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir))
    try:
        print(f"model: {cfg.num_parameters() / 1e6:.1f}M parameters, {args.saves} saves, a save every "
              f"{args.steps_between} steps, torch threads {torch.get_num_threads()}, writing to {root}", flush=True)
        results = {}
        for name, background in (("synchronous", False), ("asynchronous", True)):
            results[name] = _run(cfg, args, root, background)
            r = results[name]
            print(f"{name}: stalls {', '.join(f'{s:.2f}' for s in r['stall'])} s; writes "
                  f"{', '.join(f'{w:.2f}' for w in r['write'])} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def mean(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.2f} s" if xs else "-"

    print()
    print("| save | state per save | stall per save (median) | write (median) | step, no write beside | "
          "step, write beside |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['bytes'] / 1e9:.2f} GB | {statistics.median(r['stall']):.2f} s | "
              f"{statistics.median(r['write']):.2f} s | {mean(r['quiet'])} | {mean(r['beside'])} |")


if __name__ == "__main__":
    main()
