"""Nobody but the job can stop it: verdicts in the job's store are sealed with the job secret.

Before issue 32, a process that reached the launcher's store and wrote the
verdict key stopped the job with any status: with 3 every rank printed the
invented line and exited 3 within 2.4 s; with 0 both ranks exited 0 at step 7
of 40 without a result and the launcher waited for ever. Now such a value is
ignored, with one warning line, and the run is the run it would have been.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import REPO, torchrun
from hetpipe.errors import EXIT_CRASH, EXIT_LOST_PEER
from hetpipe.launch import verdicts
from hetpipe.launch.store_seal import Seal
from hetpipe.launch.verdicts import ABORT_KEY, namespace, post_verdict, posted_verdict

TINY = ["+model=tiny_llama", "cluster=cpu_mixed", "cluster.transport.kind=tcp", "data=demo",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.log_interval=1", "logging.progress=false"]
STEPS = 12
# Every rank pauses 4 s at step 3 (a slow step, hetpipe/process/faults.py), so
# the forgeries land mid-run however fast the steps are; the clean run pauses too.
PAUSE = "sleep=4@step:step=3"
SECRET = "c41d8e07a96f3b25e1d04c7a8b93f6e215d0a7c48e39b6f1a02d5c8e7b4f9a36"  # as secrets.token_hex(32) draws
# What a forger writes: the verdict as the ranks wrote it before issue 32.
FORGED = [{"rank": 1, "reason": "node 1 (amd) lost: invented by someone else", "code": 3, "time": 1.0},
          {"rank": 1, "reason": "all done, go home", "code": 0, "time": 2.0}]
# Whoever of the node reads a forged value first says so - a rank's watch or the
# launcher (which watches for a posted cause to end hung ranks) - once per node.
WARNING = "hetpipe: warning: "


def pretrain(run_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HETPIPE_FAULT=PAUSE)
    env.pop("HETPIPE_JOB_TOKEN", None)  # the launcher draws the job's secret itself
    return subprocess.Popen([sys.executable, "-m", "hetpipe.pretrain", *TINY, f"train.train_iters={STEPS}",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (the launcher's: the job's store)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def forge(ports: set[int], body: dict) -> None:
    """Write ``body`` as attempt 0's verdict into every store the launcher serves."""
    for port in ports:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        client.set(f"{namespace(0)}/{ABORT_KEY}", json.dumps(body))


def fields(run: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["consumed_samples"]) for r in run]


@pytest.mark.timeout(240)
def test_a_forged_verdict_neither_stops_the_run_nor_changes_it(tmp_path):
    attacked = pretrain(tmp_path / "attacked")
    until = time.monotonic() + 150
    while len(rows(tmp_path / "attacked")) < 2:
        assert attacked.poll() is None and time.monotonic() < until, attacked.communicate()
        time.sleep(0.1)
    ports = listening_ports(attacked.pid)
    assert ports, "the launcher serves no store"
    for body in FORGED:
        forge(ports, body)
        time.sleep(1.0)  # four polls of every rank's watch
    landed = len(rows(tmp_path / "attacked"))
    out, err = attacked.communicate(timeout=150)
    assert 2 <= landed < STEPS, f"the forgeries landed after step {landed} of {STEPS}"
    assert attacked.returncode == 0, (attacked.returncode, err[-3000:])
    warnings = [line for line in err.splitlines() if line.startswith(WARNING)]
    # One line for the one node, though two ranks read two forged values many times.
    assert len(warnings) == 1 and f"ignored a value of {namespace(0)}/{ABORT_KEY}" in warnings[0], err[-3000:]
    rest = "\n".join([out, *(line for line in err.splitlines() if not line.startswith(WARNING))])
    assert "hetpipe: error:" not in rest and "invented" not in rest and "go home" not in rest, err[-3000:]

    clean = pretrain(tmp_path / "clean")
    clean.communicate(timeout=150)
    assert clean.returncode == 0
    assert len(rows(tmp_path / "attacked")) == STEPS
    assert fields(rows(tmp_path / "attacked")) == fields(rows(tmp_path / "clean"))  # bitwise: floats compared exactly


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("HETPIPE_JOB_TOKEN", SECRET)
    monkeypatch.delenv("HETPIPE_JOB_TOKEN_FILE", raising=False)
    monkeypatch.setattr(verdicts, "_warned", set())  # each test's warnings are its own
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    yield server
    del server


def client(server: dist.TCPStore, attempt: int) -> dist.PrefixStore:
    return dist.PrefixStore(namespace(attempt), dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                              timeout=timedelta(seconds=5)))


def test_a_verdict_stops_only_its_own_job_and_attempt(store, capfd):
    first = client(store, 0)
    post_verdict(first, 1, "rank 1 (pid 7) was killed by SIGKILL", EXIT_CRASH, attempt=0)
    assert posted_verdict(first, attempt=0) == ("rank 1 (pid 7) was killed by SIGKILL", EXIT_CRASH)
    # Replayed into the next attempt's key (the agent keeps one store for all attempts).
    store.set(f"{namespace(1)}/{ABORT_KEY}", store.get(f"{namespace(0)}/{ABORT_KEY}"))
    assert posted_verdict(client(store, 1), attempt=1) is None
    # Sealed with another job's secret, or with a status hetpipe never posts (0: "finished").
    other = Seal("another job's secret", 2)
    store.set(f"{namespace(2)}/{ABORT_KEY}", other.seal(ABORT_KEY, {"rank": 0, "reason": "x", "code": 3, "time": 1}))
    assert posted_verdict(client(store, 2), attempt=2) is None
    ours = Seal(SECRET, 3)
    store.set(f"{namespace(3)}/{ABORT_KEY}", ours.seal(ABORT_KEY, {"rank": 0, "reason": "x", "code": 0, "time": 1}))
    assert posted_verdict(client(store, 3), attempt=3) is None
    warned = [line for line in capfd.readouterr().err.splitlines() if line.startswith("hetpipe: warning:")]
    assert len(warned) == 3 and "its status 0 is not one a verdict may have" in warned[2], warned


def test_a_real_cause_takes_the_place_of_a_forged_one(store, capfd):
    store.set(f"{namespace(0)}/{ABORT_KEY}", json.dumps(FORGED[0]))
    ours = client(store, 0)
    standing, _ = post_verdict(ours, 2, "NIC eth2 (10.202.0.2) of node 1 went down", EXIT_LOST_PEER, attempt=0)
    assert standing == ("NIC eth2 (10.202.0.2) of node 1 went down", EXIT_LOST_PEER)
    assert posted_verdict(ours, attempt=0) == standing
    assert capfd.readouterr().err.count("hetpipe: warning:") == 1


@pytest.mark.timeout(120)
def test_torchrun_without_a_secret_stops_at_start_even_without_socket_channels(tmp_path):
    # gloo carries the boundary, so no channel needs the secret; the verdicts still do.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_JOB_TOKEN")}
    begun = time.monotonic()
    cmd, env = torchrun(["--standalone", "--nproc-per-node", "2", "-m", "hetpipe.pretrain", *TINY,
                         "cluster.transport.kind=gloo", "train.train_iters=2", f"hydra.run.dir={tmp_path}"], env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=110)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    print(f"exit {proc.returncode} after {time.monotonic() - begun:.1f} s")
    assert proc.returncode != 0 and not rows(tmp_path), proc.stderr[-3000:]
    assert errors and all("] no job secret: set HETPIPE_JOB_TOKEN" in line and "seals the job's stop verdicts" in line
                          for line in errors), proc.stderr[-3000:]
