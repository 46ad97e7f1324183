"""Peers that prove who they are: the channel handshake against an attacker, and where the secret comes from.

Issue 18 found that a process which reaches torch's TCPStore (no credentials,
keys listed) could rewrite a rank's endpoint, receive the connecting rank's
job token in clear, log in to the real peer with it and relay a live run.
These tests replay that attack with real processes, real sockets and a real
TCPStore, and check what replaced the token: mutual HMAC challenge-response
bound to both nonces, both ranks, the role and the TCP 4-tuple
(comm/handshake.py), the optional per-message MAC (comm/message_mac.py), and
the secret's sources (hetpipe/launch/job_secret.py). The pytest process plays
stage 0 (or an attacker's raw socket), spawned processes play stage 1 and the
attacker. Every wait is bounded.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import select
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from channel_harness import CTX, NAMES, Ranks, bits_equal, make
from conftest import REPO, torchrun
from hetpipe.comm.channel import ChannelError, encode_header, header_for
from hetpipe.comm.handshake import (
    CHALLENGE_SIZE,
    FINAL_SIZE,
    HELLO_SIZE,
    NONCE_SIZE,
    PROOF_SIZE,
    Responder,
    SessionKeys,
    Transcript,
    Verdict,
    encode_hello,
    encode_proof,
    introduce,
)
from hetpipe.comm.message_mac import FrameMac
from hetpipe.comm.rendezvous import endpoint_key, lookup_endpoints
from hetpipe.comm.tcp import TcpChannel
from hetpipe.errors import ConfigError
from hetpipe.launch.job_secret import find_job_secret, provide_local_secret, require_job_secret

# Fixed, so spawned children (which re-import this module) hold the same one.
SECRET = "5f0d8c4e2b7a91c3e6d04f1a8b2c7e9d3a6f0b5c8e1d4a7f2c9b6e3d0a5f8c1e"
CASES = [(torch.float32, (2, 64, 128)), (torch.bfloat16, (3, 5, 7)), (torch.int64, (1000,)),
         (torch.float16, (0,)), (torch.float32, (4 * 1024 * 1024,))]


def channel(rank: int, store, **kw) -> TcpChannel:
    kw.setdefault("deadline", 15.0)
    return TcpChannel(rank, [1 - rank], NAMES, store, kw.pop("token", SECRET), **kw)


class Refusals(logging.Handler):
    """The acceptor's log lines about refused connections, collected in a child."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("hetpipe.comm.rendezvous").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    assert len(data) == size, f"peer closed after {len(data)} of {size} bytes"
    return data


def fixed_derivatives(secret: str) -> list[bytes]:
    """Values computed from the secret alone: seeing any of them on the wire would be a replayable credential."""
    raw = secret.encode()
    out = [raw, bytes.fromhex(secret), raw[:16], raw[-16:]]
    for digest in ("sha256", "sha1", "md5", "sha512"):
        out += [hashlib.new(digest, raw).digest(), hashlib.new(digest, raw).hexdigest().encode()]
    out += [hmac.new(raw, label, "sha256").digest() for label in (b"", b"acceptor", b"connector")]
    return out


# ------------------------------------------------------------- child targets

def accept_expecting_nobody(rank: int, store, deadline: float) -> tuple[str, list[str]]:
    """Stage 1 waits for stage 0; returns how that ended and the refusals it logged."""
    refusals = Refusals()
    try:
        channel(rank, store, deadline=deadline).close()
        return "connected", refusals.lines
    except ChannelError as exc:
        return f"{type(exc).__name__}: {exc}", refusals.lines


def echo_cases(rank: int, store, message_mac: bool) -> list[str]:
    """Receive every case as fwd and send it back as bwd; returns the refusals logged meanwhile."""
    refusals = Refusals()
    with channel(rank, store, message_mac=message_mac, addresses=["127.0.0.1", "127.0.0.2"]) as ch:
        for i, (dtype, shape) in enumerate(CASES):
            buf = torch.empty(shape, dtype=dtype)
            ch.irecv(buf, 0, microbatch=i, kind="fwd").wait()
            ch.isend(buf, 0, microbatch=i, kind="bwd").wait()
    return refusals.lines


def receive_tampered(rank: int, store, scenarios: int) -> list[str]:
    """With message MACs on, one fresh channel per scenario; each receives twice and reports what happened."""
    out = []
    for k in range(scenarios):
        with channel(rank, dist.PrefixStore(f"scenario-{k}", store), message_mac=True) as ch:
            for mb in range(2):
                buf = torch.empty(64, 64)
                try:
                    ch.irecv(buf, 0, microbatch=mb, kind="fwd").wait(10.0)
                    out.append("ok" if torch.equal(buf, make(torch.float32, (64, 64), mb)) else "CORRUPT")
                except ChannelError as exc:
                    out.append(str(exc))
    return out


def attacker(port: int, results, seconds: float) -> None:
    """Rewrite stage 1's endpoint to a listener of our own, take stage 0's connection, relay it to the
    real stage 1, and report every byte either side sent through us."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        streams, endpoints = lookup_endpoints(store, 1, 20.0)
        listener = socket.create_server(("127.0.0.1", 0))
        store.set(endpoint_key(1), json.dumps({"streams_per_address": streams,
                                               "endpoints": [list(listener.getsockname())]}))
        results.put(("ready", listener.getsockname()[1]))
        listener.settimeout(seconds)
        victim, _ = listener.accept()
        real = socket.create_connection(endpoints[0], timeout=seconds)
        captured = {victim: bytearray(), real: bytearray()}
        other = {victim: real, real: victim}
        until = time.monotonic() + seconds
        open_ends = {victim, real}
        while open_ends == {victim, real} and time.monotonic() < until:
            readable, _, _ = select.select(list(open_ends), [], [], 0.2)
            for sock in readable:
                data = sock.recv(1 << 16)
                if not data:
                    open_ends.discard(sock)
                    continue
                captured[sock] += data
                other[sock].sendall(data)  # relay, as the attack in the issue did
        results.put(("captured", bytes(captured[victim]), bytes(captured[real])))
    except BaseException as exc:  # the test reports it
        results.put(("error", repr(exc)))


# ------------------------------------------------ (a) the attack from the issue

@pytest.mark.timeout(60)
def test_rewritten_endpoint_gets_neither_the_secret_nor_a_relay():
    with Ranks(accept_expecting_nobody, [1], 15.0, timeout=45.0) as ranks:
        results = CTX.Queue()
        spy = CTX.Process(target=attacker, args=(ranks.store.port, results, 15.0), daemon=True)
        spy.start()
        try:
            kind, spy_port = results.get(timeout=30.0)
            assert kind == "ready", spy_port
            with pytest.raises(ChannelError) as info:
                channel(0, ranks.store, deadline=10.0)
            # Stage 0 refused the relay by name, before it proved anything or sent a byte of data.
            assert str(info.value).startswith(
                f"peer at 127.0.0.1:{spy_port} claiming to be stage 1 (group amd, rank 1) did not prove the job "
                "secret, so stage 0 (group nvidia, rank 0) refused it"), str(info.value)
            kind, *payload = results.get(timeout=20.0)
            assert kind == "captured", payload
            from_victim, from_real = payload
        finally:
            spy.join(5.0)
            if spy.is_alive():
                spy.kill()
        outcome, refusals = ranks.results()[1]
    # What the attacker holds: one HELLO (ranks, a nonce) from stage 0 and one CHALLENGE
    # from stage 1 - no proof of stage 0's, no FINAL, no frame.
    assert len(from_victim) == HELLO_SIZE and len(from_real) == CHALLENGE_SIZE
    for value in fixed_derivatives(SECRET):
        assert value not in from_victim + from_real, "the secret (or a fixed function of it) crossed the wire"
    # Stage 1 never accepted the relay: it logged the relay's half-done handshake once and
    # kept waiting for the real stage 0 until its deadline.
    assert outcome.startswith("ChannelTimeout: stage 1 (group amd, rank 1) waited 15 s for stage 0 "
                              "(group nvidia, rank 0) to connect (0 of 1 connections arrived)"), outcome
    assert len(refusals) == 1 and "closed the connection during the handshake" in refusals[0], refusals


# ------------------------------------------- (b) strangers, (c) reflection

@pytest.mark.timeout(60)
def test_strangers_are_refused_and_the_real_peer_still_moves_tensors_bit_exact():
    with Ranks(echo_cases, [1], False, timeout=40.0) as ranks:
        _, endpoints = lookup_endpoints(ranks.store, 1, 20.0)
        half_open = socket.create_connection(endpoints[0], timeout=5.0)  # says nothing at all
        garbage = socket.create_connection(endpoints[0], timeout=5.0)
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: stage1\r\n\r\n" * 4)
        guesser = socket.create_connection(endpoints[0], timeout=5.0)  # speaks the protocol, lacks the secret
        guesser.sendall(encode_hello(0, 1, 0, 2, os.urandom(NONCE_SIZE)))
        try:
            assert recv_exactly(guesser, CHALLENGE_SIZE)[4] == Verdict.ACCEPT
            guesser.sendall(encode_proof(hmac.new(b"wrong-secret", b"", "sha256").digest()))
            final = recv_exactly(guesser, FINAL_SIZE)
            assert final[4] == Verdict.WRONG_SECRET, "a wrong proof was accepted"
            with pytest.raises(ChannelError, match=r"did not prove the job secret"):
                channel(0, ranks.store, token="not-the-job-secret", addresses=["127.0.0.1", "127.0.0.2"],
                        deadline=5.0)
            with channel(0, ranks.store, addresses=["127.0.0.1", "127.0.0.2"]) as ch:
                for i, (dtype, shape) in enumerate(CASES):
                    sent, back = make(dtype, shape, seed=i), torch.empty(shape, dtype=dtype)
                    ch.isend(sent, 1, microbatch=i, kind="fwd").wait()
                    ch.irecv(back, 1, microbatch=i, kind="bwd").wait()
                    assert bits_equal(sent, back), f"{dtype} {shape} came back different"
            refusals = ranks.results()[1]
        finally:
            for sock in (half_open, garbage, guesser):
                sock.close()
    # Each stranger is logged once; the silent one was still pending when the real peer finished.
    assert len(refusals) == 3, refusals
    assert "not a hetpipe handshake" in refusals[0]
    assert "claims to be rank 0 but did not prove the job secret" in refusals[1]
    assert "closed the connection during the handshake" in refusals[2]  # the wrong-secret channel hung up


@pytest.mark.timeout(60)
def test_a_peers_own_proof_echoed_back_is_refused():
    with Ranks(echo_cases, [1], False, timeout=40.0) as ranks:
        _, endpoints = lookup_endpoints(ranks.store, 1, 20.0)
        mirror = socket.create_connection(endpoints[0], timeout=5.0)
        mirror.sendall(encode_hello(0, 1, 0, 2, os.urandom(NONCE_SIZE)))
        try:
            challenge = recv_exactly(mirror, CHALLENGE_SIZE)
            proof_a = challenge[-PROOF_SIZE:]
            mirror.sendall(encode_proof(proof_a))  # stage 1's own proof, reflected
            assert recv_exactly(mirror, FINAL_SIZE)[4] == Verdict.WRONG_SECRET
            with channel(0, ranks.store, addresses=["127.0.0.1", "127.0.0.2"]) as ch:
                for i, (dtype, shape) in enumerate(CASES):
                    sent, back = make(dtype, shape, seed=i), torch.empty(shape, dtype=dtype)
                    ch.isend(sent, 1, microbatch=i, kind="fwd").wait()
                    ch.irecv(back, 1, microbatch=i, kind="bwd").wait()
                    assert bits_equal(sent, back)
            refusals = ranks.results()[1]
        finally:
            mirror.close()
    assert len(refusals) == 1 and "did not prove the job secret" in refusals[0], refusals


def test_the_transcript_binds_role_nonces_ranks_and_addresses():
    base = Transcript(0, 1, 0, 1, b"c" * 32, b"a" * 32, ("10.0.0.4", 51000), ("10.0.0.5", 4001))
    secret = SECRET.encode()
    proof = base.proof(secret, b"acceptor")
    assert proof != base.proof(secret, b"connector"), "a proof must not be valid in the other role"
    variants = [Transcript(0, 1, 0, 1, b"c" * 32, b"b" * 32, base.connector_address, base.acceptor_address),
                Transcript(0, 2, 0, 1, b"c" * 32, b"a" * 32, base.connector_address, base.acceptor_address),
                Transcript(0, 1, 1, 2, b"c" * 32, b"a" * 32, base.connector_address, base.acceptor_address),
                # A relay at 10.0.0.9 terminates the connection: the real acceptor sees the relay's address.
                Transcript(0, 1, 0, 1, b"c" * 32, b"a" * 32, ("10.0.0.9", 40000), base.acceptor_address)]
    assert all(v.proof(secret, b"acceptor") != proof for v in variants)
    assert base.proof(b"another secret", b"acceptor") != proof
    # Fresh keys per connection, one per direction; never printed.
    c2a, a2c = base.keys(secret)
    assert c2a != a2c and variants[0].keys(secret)[0] != c2a
    assert "c2a" not in repr(SessionKeys(send=b"c2a", recv=b"a2c"))
    # An IPv4 peer on a dual-stack listener is seen as ::ffff:a.b.c.d; both sides must spell it alike.
    responder = Responder(secret=secret, rank=1, nstreams=1, local=("::ffff:10.0.0.5", 4001, 0, 0),
                          remote=("10.0.0.4", 51000), expects=lambda rank, stream: True)
    assert responder.local == ("10.0.0.5", 4001)


# --------------------------------------------------- (d) per-message MAC

@pytest.mark.timeout(60)
@pytest.mark.parametrize("message_mac", [False, True], ids=["mac-off", "mac-on"])
def test_round_trip_is_bit_exact_with_and_without_message_mac(message_mac):
    with Ranks(echo_cases, [1], message_mac, timeout=40.0) as ranks:
        with channel(0, ranks.store, message_mac=message_mac, addresses=["127.0.0.1", "127.0.0.2"]) as ch:
            for i, (dtype, shape) in enumerate(CASES):
                sent, back = make(dtype, shape, seed=i), torch.full(shape, 7, dtype=dtype)
                send = ch.isend(sent, 1, microbatch=i, kind="fwd")
                recv = ch.irecv(back, 1, microbatch=i, kind="bwd")
                send.wait()
                recv.wait()
                assert bits_equal(sent, back), f"{dtype} {shape} came back different"
        assert ranks.results()[1] == []


class Wire:
    """Collects what a FrameMac writes, so a test can alter it 'in flight' before the real send."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendall(self, data) -> None:
        self.data += bytes(data)


def sealed_frame(mac: FrameMac, seq: int, microbatch: int | None = None) -> bytearray:
    tensor = make(torch.float32, (64, 64), seq)
    head = encode_header(header_for(tensor, seq=seq, microbatch=seq if microbatch is None else microbatch, kind="fwd"))
    wire = Wire()
    mac.send_frame(wire, head, memoryview(tensor.numpy().tobytes()))
    return wire.data


@pytest.mark.timeout(60)
def test_message_mac_detects_a_flipped_byte_a_replay_and_a_reorder():
    """Stage 0 is played by a raw socket that holds the secret (an honest handshake), and its frames are
    changed after they were sealed: what an attacker on the network path could do to a live connection."""
    scenarios = ["payload byte flipped", "header byte flipped", "frame replayed", "frames reordered",
                 "authentic but unexpected"]
    with Ranks(receive_tampered, [1], len(scenarios), timeout=50.0) as ranks:
        for k, scenario in enumerate(scenarios):
            store = dist.PrefixStore(f"scenario-{k}", ranks.store)
            _, endpoints = lookup_endpoints(store, 1, 20.0)
            sock = socket.create_connection(endpoints[0], timeout=10.0)
            keys = introduce(sock, rank=0, peer=1, stream=0, nstreams=1, secret=SECRET.encode(),
                             until=time.monotonic() + 10.0, own_name=NAMES[0], peer_name=NAMES[1])
            mac = FrameMac(keys, own=NAMES[0], peer=NAMES[1], connection=0)
            first, second = sealed_frame(mac, 0), sealed_frame(mac, 1)
            if scenario == "payload byte flipped":
                second[-100] ^= 0x01
                frames = [first, second]
            elif scenario == "header byte flipped":
                second[20] ^= 0x01  # the microbatch field: 1 -> 0, still a well-formed header
                frames = [first, second]
            elif scenario == "frame replayed":
                frames = [first, first]
            elif scenario == "authentic but unexpected":
                honest = FrameMac(keys, own=NAMES[0], peer=NAMES[1], connection=0)  # counting from frame #0 again
                frames = [sealed_frame(honest, 0, microbatch=5), sealed_frame(honest, 1)]
            else:
                frames = [second, first]
            sock.sendall(b"".join(frames))
            time.sleep(0.3)
            sock.close()
        received = ranks.results()[1]
    error = ("stage 1 (group amd, rank 1) received a frame from stage 0 (group nvidia, rank 0) whose message MAC "
             "does not match its {} (frame #{} on connection 0): it was altered, replayed or reordered in flight, "
             "so the connection is no longer trusted")
    # A receive posted after the failure fails with the same cause: the connection is not used again.
    assert received == ["ok", error.format("payload", 1),
                        "ok", error.format("header", 1),
                        "ok", error.format("header", 1),
                        error.format("header", 0), error.format("header", 0),
                        # A schedule mismatch from an honest peer is rejected as always, its bytes
                        # still authenticated, and the stream stays in step.
                        "stage 1 (group amd, rank 1) expected fwd microbatch 0 float32[64, 64] from stage 0 (group "
                        "nvidia, rank 0), received fwd microbatch 5 float32[64, 64]", "ok"], received


def test_message_mac_is_refused_where_it_would_not_apply():
    from hetpipe.devices.cluster import ClusterConfig, TransportConfig

    assert ClusterConfig(transport=TransportConfig(kind="tcp", message_mac=True)).transport.message_mac
    with pytest.raises(ConfigError, match="message_mac covers the tcp channel's frames only, not kind=gloo"):
        ClusterConfig(transport=TransportConfig(kind="gloo", message_mac=True))


# ---------------------------------------------------- (e) the secret's source

def test_the_secret_comes_from_the_environment_or_an_owner_only_file(tmp_path):
    assert find_job_secret({"HETPIPE_JOB_TOKEN": "from-env", "HETPIPE_JOB_TOKEN_FILE": "/nonexistent"}) == "from-env"
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert require_job_secret({"HETPIPE_JOB_TOKEN_FILE": str(path)}) == SECRET
    path.chmod(0o644)
    with pytest.raises(ConfigError) as info:
        require_job_secret({"HETPIPE_JOB_TOKEN_FILE": str(path)})
    assert str(info.value) == f"HETPIPE_JOB_TOKEN_FILE={path} is open to group or others (mode 0644): chmod 600 it"
    with pytest.raises(ConfigError) as info:
        require_job_secret({})
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("no job secret: set HETPIPE_JOB_TOKEN") and "HETPIPE_JOB_TOKEN_FILE" in str(
        info.value)


def test_hetpipes_own_launcher_draws_a_secret_only_when_none_is_configured(tmp_path):
    env: dict[str, str] = {}
    provide_local_secret(env)
    assert len(env["HETPIPE_JOB_TOKEN"]) == 64 and int(env["HETPIPE_JOB_TOKEN"], 16) >= 0
    kept = {"HETPIPE_JOB_TOKEN": SECRET}
    provide_local_secret(kept)
    assert kept == {"HETPIPE_JOB_TOKEN": SECRET}
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o400)
    from_file = {"HETPIPE_JOB_TOKEN_FILE": str(path)}
    provide_local_secret(from_file)
    assert from_file == {"HETPIPE_JOB_TOKEN_FILE": str(path)}  # the children read the file themselves
    path.chmod(0o604)
    with pytest.raises(ConfigError, match="mode 0604"):
        provide_local_secret(from_file)  # refused before any rank starts


@pytest.mark.timeout(120)
def test_torchrun_without_a_secret_stops_with_one_line(tmp_path, corpus_prefix):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_JOB_TOKEN")}
    cmd, env = torchrun(
        ["--standalone", "--nproc-per-node", "2", "-m", "hetpipe.pretrain", "+model=tiny_llama", "cluster=cpu_mixed",
         "train.train_iters=1", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8",
         "model.hidden_size=64", "model.ffn_hidden_size=160", f"data.path={corpus_prefix}",
         f"hydra.run.dir={tmp_path}"], env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=110)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert errors and all("no job secret: set HETPIPE_JOB_TOKEN" in line for line in errors), proc.stderr[-3000:]
