"""What the data side of a training step costs at a realistic global batch:
the loader, data.eod_mask_loss's mask and count, logging.sample_log's record.

A synthetic corpus (random byte tokens in documents of 50-2000 tokens, or a
0.7/0.3 blend of two) is read at ``--seq`` tokens per sample and ``--gbs``
samples per step by the trainer's own loader on one rank in microbatches of
one sample (DP 1: the whole global batch on this process, the most any rank
reads). Per step it times, separately: the loader's step (draw the global
batch, read and stack its samples, with the EOD mask under ``--eod-mask``);
the count of the labels the token-weighted loss divides by
(hetpipe.training.token_loss.counted_tokens, which data.eod_mask_loss adds besides the
mask and one all-reduce of an integer); and the sample log's record (copy
the indices into the record, write and flush it: all that logging.sample_log
adds). Medians over ``--steps`` steps; the bytes per step are the record's.

    python scripts/bench_data_step.py [--gbs 1024] [--seq 4096] [--steps 100] [--blend] [--eod-mask]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hetpipe.data import IndexedDatasetWriter, MicrobatchLoader
from hetpipe.observe.sample_log import SampleLog
from hetpipe.training.token_loss import counted_tokens


def _corpus(prefix: Path, tokens: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2000, tokens // 1000)
    data = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint16)
    data[np.cumsum(lengths) - 1] = 256  # each document ends in EOD
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(data, lengths)
    return str(prefix)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbs", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--blend", action="store_true", help="a 0.7/0.3 blend of two corpora")
    parser.add_argument("--eod-mask", action="store_true", help="data.eod_mask_loss=true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        need = args.gbs * args.seq * 2  # two global batches' worth, so epochs wrap too
        paths = [_corpus(root / "a", need, 1)] + ([_corpus(root / "b", need, 2)] if args.blend else [])
        spec = f"0.7 {paths[0]} 0.3 {paths[1]}" if args.blend else paths[0]
        loader = MicrobatchLoader(spec, "byte", args.seq, args.gbs, micro_batch_size=1, vocab_size=257,
                                  eod_mask_loss=args.eod_mask)
        log = SampleLog(root / "run", loader, seed=1234)
        load, record, count = [], [], []
        for step in range(1, args.steps + 1):
            batch = []
            load.append(_timed(lambda: batch.extend(loader.next_step())))
            record.append(_timed(lambda: log.record(step, applied=True)))
            count.append(_timed(lambda: counted_tokens(batch)))
        log.close()
        size = (root / "run" / "samples.bin").stat().st_size // args.steps
    us = 1e6
    print(f"global batch {args.gbs} x seq {args.seq}{', 0.7/0.3 blend' if args.blend else ''}"
          f"{', EOD mask' if args.eod_mask else ''}; medians over {args.steps} steps")
    print(f"  loader step (draw, read, stack{', mask' if args.eod_mask else ''}): "
          f"{statistics.median(load) * 1e3:.1f} ms")
    print(f"  sample log record:   {statistics.median(record) * us:.1f} us, {size} bytes/step")
    print(f"  counted tokens:      {statistics.median(count) * us:.1f} us")


if __name__ == "__main__":
    main()
