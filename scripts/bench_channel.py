#!/usr/bin/env python
"""Boundary-channel microbenchmark: GB/s against message size for each transport.

Two local processes (forked from one server that imported this script)
stream messages one way, a few in flight at a time, and the receiver
acknowledges the last one; throughput is bytes moved over that time. Transports measured:

* ``tcp`` with one connection and with ``len(--addresses) * --streams``
  striped connections (give one local address per NIC to see multi-NIC gains);
* ``gloo``, the header-checked reference channel;
* with ``--message-mac``: ``tcp+mac``, both tcp runs again with the per-frame
  MAC on (``cluster.transport.message_mac``), to price integrity;
* with ``--device cuda`` and two visible GPUs: ``nccl-p2p`` (torch P2P on an
  NCCL group, what a same-vendor boundary uses) and ``peer-copy`` (one
  process copying GPU 0 -> GPU 1, the device-direct ceiling).

With ``--device cuda`` the tcp and gloo numbers include the device <-> host
staging. Runtime is bounded: each measurement moves a fixed byte budget
(fewer with ``--quick``) and the whole run stops at ``--time-limit``.

Across two hosts (or two emulated nodes, scripts/emulated_nodes.py), run one
process per host with ``--rank 0`` / ``--rank 1`` and ``--store`` naming rank
0's host: rank 0 hosts the store there and prints the table. Each host
resolves ``--interfaces`` or ``--subnets`` to its own NICs, as
``cluster.transport`` does, and the two tcp rows are then one NIC against all
of them, every message striped over the NICs:

    python scripts/bench_channel.py --rank 0 --store 10.201.0.1:29500 --subnets 10.201.0.0/24,10.202.0.0/24 \
        --streams 1 --sizes 1MiB --budget-mib 8     # and --rank 1 on the other host

    python scripts/bench_channel.py --quick --device cpu
    python scripts/bench_channel.py --transports tcp --message-mac --sizes 1MiB,16MiB,64MiB
    python scripts/bench_channel.py --device cuda --addresses 10.0.0.1,10.0.1.1 --streams 2
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import queue
import secrets
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from hetpipe.devices.cluster import TransportConfig
from hetpipe.comm.direct import DirectChannel
from hetpipe.comm.gloo import GlooChannel
from hetpipe.comm.nics import check_dialable, resolve_local_nics, selection_setting, socket_ifname
from hetpipe.comm.p2p import TorchP2PChannel
from hetpipe.comm.tcp import TcpChannel
from hetpipe.errors import HetpipeError
from hetpipe.launch.job_secret import find_job_secret

KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
QUICK_SIZES = [64 * KIB, MIB, 16 * MIB]
WINDOW = 4  # messages in flight, like a pipeline with a few microbatches queued
MAX_MESSAGES = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the sent and received tensors live")
    parser.add_argument("--quick", action="store_true", help="three sizes and a small byte budget (about 15 s)")
    parser.add_argument("--streams", type=int, default=4, help="tcp connections per address for the striped run")
    parser.add_argument("--addresses", default="127.0.0.1",
                        help="comma-separated local addresses, one per NIC, for the striped tcp run")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds before the run is abandoned (default 60 quick, 600 full)")
    parser.add_argument("--message-mac", action="store_true",
                        help="also run tcp with the per-frame MAC on (rows tcp+mac)")
    parser.add_argument("--transports", default=None,
                        help="comma-separated subset of tcp,tcp+mac,direct,gloo,nccl-p2p,peer-copy (default: all)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated message sizes such as 1MiB,16MiB,64MiB (default: the built-in list)")
    parser.add_argument("--budget-mib", type=int, default=None,
                        help="bytes each measurement moves, in MiB (default 32 quick, 1024 full)")
    parser.add_argument("--rank", type=int, choices=(0, 1), default=None,
                        help="two hosts: this host's rank (run the other with the other rank); tcp only")
    parser.add_argument("--store", default=None, help="two hosts: HOST:PORT of rank 0's store")
    nics = parser.add_mutually_exclusive_group()
    nics.add_argument("--interfaces", default=None, help="two hosts: NICs by name, e.g. eth1,eth2")
    nics.add_argument("--subnets", default=None, help="two hosts: NICs by network, e.g. 10.201.0.0/24,10.202.0.0/24")
    args = parser.parse_args(argv)
    args.addresses = [a.strip() for a in args.addresses.split(",") if a.strip()]
    args.transports = None if args.transports is None else {t.strip() for t in args.transports.split(",")}
    if args.sizes is not None:
        units = {"KiB": KIB, "MiB": MIB}
        try:
            args.sizes = [int(size[:-3]) * units[size[-3:]] for size in args.sizes.split(",")]
        except (KeyError, ValueError):
            parser.error(f"--sizes {args.sizes!r}: give sizes such as 64KiB,1MiB,16MiB")
    if args.time_limit is None:
        args.time_limit = 60.0 if args.quick else 600.0
    if (args.rank is None) != (args.store is None) or (args.rank is None and (args.interfaces or args.subnets)):
        parser.error("--rank and --store go together, and --interfaces/--subnets need them")
    return args


def human(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def stream_messages(channel, rank: int, nbytes: int, device: torch.device, budget: int) -> float:
    """Rank 0 sends, rank 1 receives; returns GB/s seen by rank 0 (0.0 on rank 1)."""
    count = max(3, min(MAX_MESSAGES, budget // nbytes))
    peer = 1 - rank
    data = torch.randn(nbytes // 4, device=device) if rank == 0 else torch.empty(nbytes // 4, device=device)
    ack = torch.zeros(1, device=device)

    def one_way(messages: int) -> None:
        in_flight: collections.deque = collections.deque()
        for i in range(messages):
            if rank == 0:
                in_flight.append(channel.isend(data, peer, microbatch=i, kind="fwd"))
            else:
                in_flight.append(channel.irecv(data, peer, microbatch=i, kind="fwd"))
            if len(in_flight) >= WINDOW:
                in_flight.popleft().wait()
        for handle in in_flight:
            handle.wait()
        if rank == 0:
            channel.irecv(ack, peer, microbatch=messages, kind="bwd").wait()
        else:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the last host-to-device copy counts too
            channel.isend(ack, peer, microbatch=messages, kind="bwd").wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    one_way(1)  # warm-up: connections, pinned buffers, NCCL communicators
    start = time.perf_counter()
    one_way(count)
    elapsed = time.perf_counter() - start
    return count * nbytes / elapsed / 1e9 if rank == 0 else 0.0


def peer_copy(nbytes: int, budget: int) -> float:
    """GB/s of a plain GPU 0 -> GPU 1 copy, the ceiling a device-direct channel aims at."""
    count = max(3, min(MAX_MESSAGES, budget // nbytes))
    src = torch.randn(nbytes // 4, device="cuda:0")
    dst = torch.empty(nbytes // 4, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    start = time.perf_counter()
    for _ in range(count):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return count * nbytes / (time.perf_counter() - start) / 1e9


def worker(rank: int, port: int, opts: dict, results) -> None:
    try:
        results.put(("rows", rank, run_rank(rank, port, opts)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def run_rank(rank: int, port: int, opts: dict) -> list[tuple[str, int, int, float]]:
    store = dist.TCPStore(opts["store_host"], port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    if opts["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    names = {0: "bench rank 0 (sender)", 1: "bench rank 1 (receiver)"}
    addresses, streams = opts["addresses"], opts["streams"]

    def tcp(addrs: list[str], per_address: int, mac: bool = False):
        prefix = f"tcp-{len(addrs)}x{per_address}{'-mac' if mac else ''}"
        return lambda: TcpChannel(rank, [1 - rank], names, dist.PrefixStore(prefix, store), opts["token"],
                                  addresses=addrs, streams_per_address=per_address, deadline=120.0, device=device,
                                  message_mac=mac)

    transports = [("tcp", 1, tcp(addresses[:1], 1)),
                  ("tcp", len(addresses) * streams, tcp(addresses, streams)),
                  *([("tcp+mac", 1, tcp(addresses[:1], 1, mac=True)),
                     ("tcp+mac", len(addresses) * streams, tcp(addresses, streams, mac=True))]
                    if opts["message_mac"] else []),
                  ("direct", 1, lambda: DirectChannel(rank, [1 - rank], names, dist.PrefixStore("direct", store),
                                                      opts["token"], deadline=120.0, device=device,
                                                      address=addresses[0])),
                  ("gloo", 1, lambda: GlooChannel(rank, [1 - rank], names, None, deadline=120.0))]
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    if two_gpus:
        nccl = dist.new_group([0, 1], backend="nccl")
        transports.append(("nccl-p2p", 1, lambda: TorchP2PChannel(rank, [1 - rank], names,
                                                                  {(0, 1): nccl, (1, 0): nccl}, deadline=120.0)))
    if opts["transports"] is not None:
        transports = [t for t in transports if t[0] in opts["transports"]]
    rows = []
    for transport, nstreams, make in transports:
        channel = make()
        try:
            for nbytes in opts["sizes"]:
                gbps = stream_messages(channel, rank, nbytes, device, opts["budget"])
                if rank == 0:
                    rows.append((transport, nstreams, nbytes, gbps))
                    print(f"{transport:>9} {nstreams:>3} streams {human(nbytes):>7}: {gbps:7.3f} GB/s",
                          file=sys.stderr, flush=True)
        finally:
            channel.close()
        dist.barrier()
    if two_gpus and rank == 0 and (opts["transports"] is None or "peer-copy" in opts["transports"]):
        for nbytes in opts["sizes"]:
            rows.append(("peer-copy", 1, nbytes, peer_copy(nbytes, opts["budget"])))
    dist.barrier()
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_channel: error: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    opts = {"device": args.device, "addresses": args.addresses, "streams": args.streams,
            "sizes": args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES),
            "message_mac": args.message_mac, "transports": args.transports, "store_host": "127.0.0.1",
            "budget": (args.budget_mib or (32 if args.quick else 1024)) * MIB, "token": secrets.token_hex(16)}
    if args.rank is not None:
        return two_hosts(args, opts)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])  # torch and hetpipe imported once, not once per process
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, store.port, opts, results), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    until = time.monotonic() + args.time_limit
    rows, failures = None, []
    try:
        for _ in procs:
            kind, rank, payload = results.get(timeout=max(until - time.monotonic(), 0.1))
            if kind == "error":
                failures.append(f"rank {rank} failed:\n{payload}")
            elif rank == 0:
                rows = payload
    except queue.Empty:
        failures.append(f"gave up after {args.time_limit:g} s (--time-limit)")
    finally:
        failures += stop_ranks(procs, 30.0 if not failures else 0.5)
    failure = "\n".join(failures) or None
    if failure is not None or rows is None:
        print(f"bench_channel: error: {failure}", file=sys.stderr)
        return 1
    where = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0)
    print_table(f"2 local processes, device {where}, addresses {','.join(args.addresses)}", rows)
    return 0


def stop_ranks(procs: list, wait_s: float) -> list[str]:
    """Join the rank processes (killing any still there after ``wait_s``) and
    say how each that did not exit 0 ended: its numbers are no measurement."""
    failures = []
    for rank, proc in enumerate(procs):
        proc.join(wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            failures.append(f"rank {rank} failed (did not exit within {wait_s:g} s; killed)")
        elif proc.exitcode:
            failures.append(f"rank {rank} failed ({exit_failure(proc.exitcode)})")
    return failures


def exit_failure(code: int) -> str:
    """A process's non-zero exit code as 'exit N' or 'signal NAME' (multiprocessing's -N)."""
    if code > 0:
        return f"exit {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def print_table(setting: str, rows: list[tuple[str, int, int, float]]) -> None:
    print(f"channel bandwidth, {setting}")
    print(f"{'transport':<10} {'streams':>7} {'size':>8} {'GB/s':>8} {'MB/s':>9}")
    print("-" * 46)
    for transport, nstreams, nbytes, gbps in rows:
        print(f"{transport:<10} {nstreams:>7} {human(nbytes):>8} {gbps:>8.3f} {gbps * 1000:>9.1f}")


def two_hosts(args: argparse.Namespace, opts: dict) -> int:
    """This host's half of a two-host run: its NICs, the store on rank 0, one rank's loop."""
    host, _, port = args.store.rpartition(":")
    token = find_job_secret(os.environ)
    if token is None:
        print("bench_channel: error: two hosts need the same secret on both: set HETPIPE_JOB_TOKEN",
              file=sys.stderr)
        return 2
    try:
        split = (lambda value: [v.strip() for v in value.split(",") if v.strip()] if value else None)
        transport = TransportConfig(addresses=args.addresses, interfaces=split(args.interfaces),
                                    subnets=split(args.subnets))
        nics = resolve_local_nics(transport)
        check_dialable([nic.address for nic in nics], True, selection_setting(transport))
        # The world group (barriers between measurements) must not take the
        # address the host name resolves to: loopback, often.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", socket_ifname(nics[:1]))
    except HetpipeError as exc:
        print(f"bench_channel: error: {exc}", file=sys.stderr)
        return 2
    opts.update(addresses=[nic.address for nic in nics], store_host=host, token=token,
                transports=opts["transports"] or {"tcp"})

    def give_up(signum: int, frame: object) -> None:
        print(f"bench_channel: error: gave up after {args.time_limit:g} s (--time-limit)", file=sys.stderr, flush=True)
        os._exit(1)

    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(max(1, round(args.time_limit)))
    if args.rank == 0:  # kept alive by this process while both ranks run
        server = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,  # noqa: F841
                               timeout=timedelta(seconds=args.time_limit))
    rows = run_rank(args.rank, int(port), opts)
    if args.rank == 0:
        names = ", ".join(f"{nic.name} {nic.address}" for nic in nics)
        print_table(f"2 hosts, device {args.device}, NICs {names}", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
