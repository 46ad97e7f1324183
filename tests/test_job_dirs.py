"""One live job per run directory and per checkpoint directory (hetpipe/launch/dir_lock.py).

Two jobs on one directory used to both exit 0 and leave the first job's files
holding the second's steps, seed and checkpoint bytes. Now the second is
refused in one line naming the owner, exit 2, before it writes a byte, and
the first job's files are bitwise what it writes alone (timings aside).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli, run_pretrain
from hetpipe.errors import HetpipeError
from hetpipe.launch import dir_lock

pytestmark = pytest.mark.timeout(240)

TINY = ["+model=tiny_llama", "data=demo", "model.hidden_size=64", "model.ffn_hidden_size=160",
        "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
        "logging.progress=false", "train.train_iters=4", "checkpoint.save_interval=2"]
# What a run writes that differs between two runs of the same job: how long things took.
TIMINGS = ("step_time_s", "tokens_per_s")


def job_files(run: Path, ckpt: Path) -> dict[str, bytes]:
    """Every file the job wrote into both directories, metrics.jsonl without its timings."""
    files = {f"run/{p.relative_to(run)}": p.read_bytes() for p in run.rglob("*") if p.is_file()}
    files |= {f"ckpt/{p.relative_to(ckpt)}": p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    rows = [json.loads(line) for line in files.pop("run/metrics.jsonl").decode().splitlines()]
    files["run/metrics.jsonl rows"] = json.dumps([{k: v for k, v in row.items() if k not in TIMINGS}
                                                  for row in rows]).encode()
    files.pop("run/.hydra/hydra.yaml")  # hydra's own record of this process (its pid, cwd)
    # The console (hetpipe/observe/console_log.py) holds timings and free memory: its steps and its lines' kinds are
    # what must be this job's alone.
    log = files.pop("run/pretrain.log").decode()
    files["run/pretrain.log steps"] = "\n".join(re.findall(r"step +\d+/\d+ \| loss \S+", log)).encode()
    return files


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def start_paused_at_step_2(run: Path, ckpt: Path) -> subprocess.Popen:
    """The job in its own interpreter, stopped (SIGSTOP) once step 2 is logged: it holds both
    directories while the test runs other jobs on them. A sleep at step 3 leaves time to stop it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", HETPIPE_FAULT="sleep=5@step:step=3")
    proc = subprocess.Popen([sys.executable, "-m", "hetpipe.pretrain", *TINY, f"checkpoint.save_dir={ckpt}",
                             f"hydra.run.dir={run}"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while logged_steps(run) < 2:
        if proc.poll() is not None:
            pytest.fail(f"the first job ended before step 2: {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    return proc


def test_a_second_job_is_refused_and_the_first_keeps_its_files_bitwise(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run_pretrain(run, [*TINY, f"checkpoint.save_dir={ckpt}"])
    alone = job_files(run, ckpt)
    for directory in (run, ckpt):
        subprocess.run(["rm", "-rf", str(directory)], check=True)

    first = start_paused_at_step_2(run, ckpt)
    try:
        # Another seed on the same run directory, then on the same checkpoint directory.
        same_run = run_cli(["-m", "hetpipe.pretrain", *TINY, "train.seed=7", f"hydra.run.dir={run}"])
        same_ckpt = run_cli(["-m", "hetpipe.pretrain", *TINY, "train.seed=7", f"checkpoint.save_dir={ckpt}",
                             f"hydra.run.dir={tmp_path / 'run2'}"])
        assert first.poll() is None, "the first job ended while the others ran: they did not overlap"
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=200)
    assert first.returncode == 0, (out[-2000:], err[-3000:])

    owner = rf"job \w+ \(host {re.escape(socket.gethostname())}, pid {first.pid}, since [0-9: -]+\)"
    for proc, label, setting in ((same_run, f"run directory {run}", "hydra.run.dir"),
                                 (same_ckpt, f"checkpoint directory {ckpt}", "checkpoint.save_dir")):
        assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
        assert re.fullmatch(rf"hetpipe: error: {re.escape(label)} is in use by {owner}: wait for it to end or "
                            rf"choose another {setting} \(lock file {re.escape(label.split()[-1])}/\.hetpipe\.lock\)\n",
                            proc.stderr), proc.stderr
    assert job_files(run, ckpt) == alone
    assert not (run / ".hetpipe.lock").exists() and not (ckpt / ".hetpipe.lock").exists()


def write_lock(directory: Path, **fields) -> Path:
    owner = {"host": socket.gethostname(), "boot": dir_lock.Owner.me().boot, "pid": os.getpid(),
             "job": "j0", "since": "2026-01-02 03:04:05", **fields}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / dir_lock.LOCK_NAME
    path.write_text(json.dumps(owner) + "\n")
    return path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_of_a_dead_process_on_this_host_is_taken_over_with_a_note(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    pid = dead_pid()
    for directory in (run, ckpt):
        write_lock(directory, pid=pid, job="crashed")
    proc, rows = run_pretrain(run, [*TINY, "train.train_iters=1", f"checkpoint.save_dir={ckpt}"])
    notes = [line for line in proc.stdout.splitlines() if "which is gone" in line]
    owner = f"job crashed (host {socket.gethostname()}, pid {pid}, since 2026-01-02 03:04:05)"
    assert notes == [f"hetpipe: note: run directory {run} was locked by {owner}, which is gone; taking it over",
                     f"hetpipe: note: checkpoint directory {ckpt} was locked by {owner}, which is gone; "
                     "taking it over"], proc.stdout[-3000:]
    assert [row["step"] for row in rows] == [1]
    assert not (run / ".hetpipe.lock").exists() and not (ckpt / ".hetpipe.lock").exists()


def test_a_lock_from_another_host_is_refused_before_hydra_writes(tmp_path):
    run = tmp_path / "run"
    lock = write_lock(run, host="elsewhere", boot="another-boot", pid=1, job="far")
    proc = run_cli(["-m", "hetpipe.pretrain", *TINY, f"hydra.run.dir={run}"])
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.stderr == (f"hetpipe: error: run directory {run} is locked by job far (host elsewhere, pid 1, since "
                           f"2026-01-02 03:04:05), which cannot be checked from host {socket.gethostname()}: if "
                           f"that job has ended, delete {lock} or add checkpoint.break_lock=true\n")
    assert sorted(p.name for p in run.iterdir()) == [dir_lock.LOCK_NAME]  # no .hydra/, no pretrain.log


def test_break_lock_takes_over_a_lock_from_another_host_but_never_a_live_one(tmp_path, capsys):
    far, here = tmp_path / "far", tmp_path / "here"
    write_lock(far, host="elsewhere", boot="another-boot", pid=1, job="far")
    assert dir_lock.acquire(far, "checkpoint directory", "checkpoint.save_dir", break_lock=True)
    assert "breaking the lock of job far (host elsewhere" in capsys.readouterr().out
    dir_lock.release(far)
    assert not (far / dir_lock.LOCK_NAME).exists()
    # A job alive on this host (the test itself, its flock taken by another open file) stays.
    lock = write_lock(here, job="alive")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(HetpipeError, match=r"is in use by job alive"):
            dir_lock.acquire(here, "checkpoint directory", "checkpoint.save_dir", break_lock=True)


def test_ranks_of_one_torchrun_job_share_a_directory_and_other_jobs_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "hetpipe-cpu_mixed")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    # Another rank of this job (another process on this host) holds the save directory.
    lock = write_lock(tmp_path, pid=os.getppid(), job=dir_lock.job_id())
    with open(lock) as other_rank:
        fcntl.flock(other_rank, fcntl.LOCK_EX)
        assert dir_lock.acquire(tmp_path, "checkpoint directory", "checkpoint.save_dir")
        dir_lock.release(tmp_path)
        assert lock.exists(), "a rank that joined removed the owner's lock"
        # The same rendezvous id on another store is another job.
        monkeypatch.setenv("MASTER_PORT", "29500")
        with pytest.raises(HetpipeError, match=r"is in use by job hetpipe-cpu_mixed@10\.0\.0\.1:29400"):
            dir_lock.acquire(tmp_path, "checkpoint directory", "checkpoint.save_dir")
    # The rank that held it is gone (a restarted attempt): a rank of the job holds it in its place.
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert dir_lock.acquire(tmp_path, "checkpoint directory", "checkpoint.save_dir")
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    dir_lock.release(tmp_path)
    assert not lock.exists()


def test_a_second_multirun_on_a_sweep_directory_is_refused_before_it_writes(tmp_path):
    sweep = tmp_path / "sweep"
    dir_lock.acquire(sweep, "sweep directory", "hydra.sweep.dir")  # this test process's job holds it
    try:
        proc = run_cli(["-m", "hetpipe.pretrain", "-m", *TINY, "train.seed=1,2", f"hydra.sweep.dir={sweep}"])
    finally:
        dir_lock.release(sweep)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert re.fullmatch(rf"hetpipe: error: sweep directory {re.escape(str(sweep))} is in use by job \w+ \(host "
                        rf"\S+, pid {os.getpid()}, since [0-9: -]+\): wait for it to end or choose another "
                        r"hydra.sweep.dir \(lock file \S+\)\n", proc.stderr), proc.stderr
    assert list(sweep.iterdir()) == []  # no multirun.yaml, no job directory
