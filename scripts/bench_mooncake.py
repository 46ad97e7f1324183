#!/usr/bin/env python
"""The Mooncake mover against the other boundary transports: bit-exact or not, and GB/s against message size.

Two local processes (rank 0 sends, rank 1 receives) run each transport in
turn: ``tcp`` (the CPU-forwarding channel, one connection), ``ipc`` (the
device-direct channel's GPU IPC mover; GPUs only), ``mooncake-tcp`` (the
device-direct channel over Mooncake's TCP transport, what CI runs) and
``mooncake-rdma`` (over Mooncake's RDMA transport; only where
/sys/class/infiniband lists a device, and then the first run of GPU memory
over RDMA). For each size the receiver first checks three messages of distinct
random content bit for bit, then a fixed byte budget streams with four
messages in flight. Both processes share one GPU when only one is visible,
which is enough to exercise registration of GPU memory and the stream
ordering of the landing copy.

On a GPU machine without internet access, bring the wheel of its runtime
(``pip download --no-deps mooncake-transfer-engine-cuda13``, for its Python)
and rdma-core's libraries as .debs (``apt-get download libibverbs1
ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4`` and
libcurl4's libraries) in one folder, DIR, then link into a private folder
only the libraries the machine lacks:

    mkdir -p /tmp/mc /tmp/mclib; for d in DIR/*.deb; do dpkg -x $d /tmp/mc; done
    for f in /tmp/mc/usr/lib/x86_64-linux-gnu/lib*.so*; do
      ldconfig -p | grep "[[:space:]]$(basename $f) " >/dev/null || ln -sf $f /tmp/mclib/; done
    export LD_LIBRARY_PATH=/tmp/mclib
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . DIR/*.whl
    PYTHONPATH=/tmp/site python3 scripts/bench_mooncake.py --device cuda --out mooncake.json

    python scripts/bench_mooncake.py --device cpu --sizes 64KiB,1MiB --budget-mib 16
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import queue
import secrets
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# mooncake itself is optional: mooncake_mover imports it only when a mover is built.
from hetpipe.comm.direct import DirectChannel
from hetpipe.comm.mooncake_mover import MooncakeMover, rdma_devices, unavailable_reason
from hetpipe.comm.tcp import TcpChannel

from bench_channel import stop_ranks  # noqa: E402 - beside this script (sys.path[0] when run as one)

KIB, MIB = 1024, 1024 * 1024
SIZES = [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
TRANSPORTS = ("tcp", "ipc", "mooncake-tcp", "mooncake-rdma")
WINDOW = 4
CHECKED = 3  # messages compared bit for bit per size
NAMES = {0: "bench rank 0 (sender)", 1: "bench rank 1 (receiver)"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated subset of {TRANSPORTS}")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes such as 64KiB,1MiB,16MiB")
    parser.add_argument("--budget-mib", type=int, default=256, help="bytes each measurement streams, in MiB")
    parser.add_argument("--deadline", type=float, default=60.0, help="every channel wait's deadline, seconds")
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds before the run is abandoned")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(args.transports) - set(TRANSPORTS)
    if unknown:
        parser.error(f"--transports: unknown {sorted(unknown)}; choose from {TRANSPORTS}")
    if args.sizes is None:
        args.sizes = SIZES
    else:
        units = {"KiB": KIB, "MiB": MIB}
        try:
            args.sizes = [int(s[:-3]) * units[s[-3:]] for s in args.sizes.split(",")]
        except (KeyError, ValueError):
            parser.error(f"--sizes {args.sizes!r}: give sizes such as 64KiB,1MiB,16MiB")
    return args


def human(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def content(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """Message ``seed`` of ``nbytes``: random bytes both ranks can regenerate."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device)


def build(kind: str, rank: int, store: dist.Store, token: str, device: torch.device, deadline: float):
    prefixed = dist.PrefixStore(kind, store)
    if kind == "tcp":
        return TcpChannel(rank, [1 - rank], NAMES, prefixed, token, addresses=["127.0.0.1"], streams_per_address=1,
                          deadline=deadline, device=device)
    mover = "ipc" if kind == "ipc" else MooncakeMover(protocol=kind.split("-")[1], deadline=deadline, device=device)
    return DirectChannel(rank, [1 - rank], NAMES, prefixed, token, mover=mover, deadline=deadline, device=device)


def measure(channel, rank: int, nbytes: int, device: torch.device, budget: int,
            first_mb: int) -> tuple[int, float, int]:
    """(messages that differed, GB/s on rank 0, next microbatch id) for one size, starting at ``first_mb``."""
    peer, mb = 1 - rank, first_mb
    wrong = 0
    for seed in range(CHECKED):
        expected = content(nbytes, seed, device)
        if rank == 0:
            channel.isend(expected, peer, microbatch=mb, kind="fwd").wait()
        else:
            got = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            channel.irecv(got, peer, microbatch=mb, kind="fwd").wait()
            wrong += int(not torch.equal(got, expected))
        mb += 1
    count = max(3, min(1000, budget // nbytes))
    data = content(nbytes, 99, device)
    ack = torch.zeros(1, device=device)
    start = time.perf_counter()
    in_flight: collections.deque = collections.deque()
    for _ in range(count):
        post = channel.isend if rank == 0 else channel.irecv
        in_flight.append(post(data, peer, microbatch=mb, kind="fwd"))
        mb += 1
        if len(in_flight) >= WINDOW:
            in_flight.popleft().wait()
    for handle in in_flight:
        handle.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the receiver's landing copies count too
    if rank == 0:
        channel.irecv(ack, peer, microbatch=mb, kind="bwd").wait()
    else:
        channel.isend(ack, peer, microbatch=mb, kind="bwd").wait()
    return wrong, count * nbytes / (time.perf_counter() - start) / 1e9, mb + 1


def run_rank(rank: int, port: int, opts: dict) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    device = torch.device("cpu")
    if opts["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = []
    for kind in opts["transports"]:
        skip = (unavailable_reason() if kind.startswith("mooncake") else None) or \
            ("no RDMA device in /sys/class/infiniband" if kind == "mooncake-rdma" and not rdma_devices() else None) or \
            ("needs --device cuda" if kind == "ipc" and device.type != "cuda" else None)
        if skip:
            rows.append({"transport": kind, "skipped": skip})
            continue
        try:
            with build(kind, rank, store, opts["token"], device, opts["deadline"]) as channel:
                mover = getattr(getattr(channel, "mover", None), "name", kind)
                mb = 0
                for nbytes in opts["sizes"]:
                    wrong, gbps, mb = measure(channel, rank, nbytes, device, opts["budget"], mb)
                    rows.append({"transport": kind, "mover": mover, "bytes": nbytes, "wrong": wrong, "gbps": gbps})
                if hasattr(channel, "mover"):
                    rows.append({"transport": kind, "registrations": channel.mover.registrations})
        except Exception as exc:  # one transport failing must not hide the others' rows
            rows.append({"transport": kind, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def worker(rank: int, port: int, opts: dict, results) -> None:
    try:
        results.put((rank, "ok", run_rank(rank, port, opts)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_mooncake: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    opts = {"device": args.device, "transports": args.transports, "sizes": args.sizes,
            "budget": args.budget_mib * MIB, "deadline": args.deadline, "token": secrets.token_hex(16)}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, opts, results), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    got: dict[int, list[dict]] = {}
    until = time.monotonic() + args.time_limit
    failures: list[str] = []
    try:
        while len(got) < 2:
            rank, status, value = results.get(timeout=max(until - time.monotonic(), 0.1))
            if status != "ok":
                failures.append(f"rank {rank} failed:\n{value}")
                break
            got[rank] = value
    except queue.Empty:
        failures.append(f"abandoned after {args.time_limit:g} s")
    finally:
        # A rank that delivered its numbers and then exited non-zero is a failed run too.
        failures += stop_ranks(procs, 30.0 if not failures else 5.0)
    if failures:
        print("bench_mooncake: " + "\n".join(failures), file=sys.stderr)
        return 1
    # Rank 0 timed the stream; rank 1 compared the bytes.
    def key(row: dict) -> tuple:
        return row["transport"], next(k for k in ("bytes", "registrations", "skipped", "error") if k in row), \
            row.get("bytes")

    receiver = {key(r): r for r in got[1]}
    rows = []
    print(f"device {args.device}: {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    print(f"{'transport':<14} {'mover':<14} {'size':>7} {'GB/s':>8}  bit-exact")
    for row in got[0]:
        extra = receiver.get(key(row), {})
        if "bytes" in row:
            row["receiver_wrong"] = extra.get("wrong")
            exact = "yes" if row["receiver_wrong"] == 0 else f"NO ({row['receiver_wrong']}/{CHECKED} differ)"
            print(f"{row['transport']:<14} {row['mover']:<14} {human(row['bytes']):>7} {row['gbps']:8.2f}  {exact}")
        elif "registrations" in row:
            row["receiver_registrations"] = extra.get("registrations")
            print(f"{row['transport']:<14} registrations: sender {row['registrations']}, "
                  f"receiver {row['receiver_registrations']}")
        else:
            print(f"{row['transport']:<14} {row.get('skipped') or row.get('error')}"
                  + (f" | receiver: {extra['error']}" if "error" in row and extra.get("error") else ""))
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)
    return 0 if all(r.get("receiver_wrong") in (None, 0) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
