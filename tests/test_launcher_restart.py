"""The launcher's side of restarts and preemption, through ``python -m hetpipe.pretrain``.

Restarts: with ``train.max_restarts=N`` torch's elastic agent starts every
rank again after one dies; the launcher prints one line per restart naming the
cause, and once no restart is left reports the cause as any failure. A
restarted attempt shares the agent's store with the failed one (torch keeps
one store server for all attempts of a launch; the same port, the failed
attempt's keys still there): without hetpipe's per-attempt namespace the
restarted ranks would read the failed attempt's verdict, or dial the dead
ranks' addresses, and never train.

Preemption: SIGTERM (and SIGUSR1, when ``train.preemption_signals`` lists it)
sent to the launcher mid-training is forwarded to the ranks, which finish
their step, save a checkpoint and exit 0; the job exits 0 with rank 0's line.

Each run is a tiny two-rank mixed model on CPU, a few seconds per attempt.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(240)

TINY = ["+model=tiny_llama", "cluster=cpu_mixed", "cluster.transport.kind=tcp", "data=demo",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.log_interval=1", "logging.progress=false"]
RESTART = re.compile(r"hetpipe: rank 1 \(pid \d+\) was killed by SIGKILL; restarting the job \(restart 1 of 1\)")


def start(run_dir: Path, *overrides: str, fault: str = "", session: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    env.pop("HETPIPE_FAULT", None)
    if fault:
        env["HETPIPE_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "hetpipe.pretrain", *TINY, *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=session)


def finish(proc: subprocess.Popen, timeout: float = 200) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["step"] for row in rows if "loss" in row]


@pytest.mark.torch_matrix
def test_a_killed_rank_restarts_the_job_which_then_completes(tmp_path):
    run = tmp_path / "run"
    code, out, err = finish(start(run, "train.train_iters=4", "train.max_restarts=1", "checkpoint.save_interval=2",
                                  fault="kill@step:rank=1:step=3"))
    assert code == 0, (code, out[-2000:], err[-3000:])
    restarts = [line for line in err.splitlines() if "restarting the job" in line]
    assert len(restarts) == 1 and RESTART.fullmatch(restarts[0]), err[-3000:]
    # The restarted attempt trained to the end (resuming from step 2's checkpoint).
    assert steps(run)[-1] == 4, (steps(run), err[-3000:])
    # Whatever the ranks said came before the restart; nothing was said after it.
    after = err.split(restarts[0], 1)[1]
    assert "hetpipe: error:" not in after and "Traceback" not in err, err[-3000:]


def test_a_rank_that_dies_again_after_the_last_restart_is_reported_as_the_cause(tmp_path):
    code, out, err = finish(start(tmp_path / "run", "train.train_iters=4", "train.max_restarts=1",
                                  fault="kill@step:rank=1:step=3:attempt=any"))
    assert code == 1, (code, out[-2000:], err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("hetpipe: ")]
    restart = next(i for i, line in enumerate(lines) if RESTART.fullmatch(line))
    errors = [line for line in lines[restart + 1:] if line.startswith("hetpipe: error: ")]
    assert re.fullmatch(r"hetpipe: error: rank 1 \(pid \d+\) was killed by SIGKILL", errors[0]), err[-3000:]
    assert all("SIGKILL" in line for line in errors) and "lost" not in err, err[-3000:]


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, count: int, timeout: float = 120) -> None:
    until = time.monotonic() + timeout
    while len(steps(run_dir)) < count:
        if proc.poll() is not None or time.monotonic() > until:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no {count} steps (exit {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.1)


@pytest.mark.torch_matrix
@pytest.mark.parametrize("sig, overrides", [
    (signal.SIGTERM, []),
    (signal.SIGUSR1, ["train.preemption_signals=[SIGTERM,SIGUSR1]"]),
], ids=["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_to_the_launcher_saves_and_exits_0(tmp_path, sig, overrides):
    run = tmp_path / "run"
    proc = start(run, "train.train_iters=100000", *overrides)
    wait_for_steps(proc, run, 2)
    proc.send_signal(sig)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, (code, out[-2000:], err[-3000:])
    said = re.search(rf"^hetpipe: preempted by {sig.name} after step (\d+): checkpoint (\S+) saved; exiting 0$",
                     out, re.MULTILINE)
    assert said, (out[-2000:], err[-3000:])
    assert int(said.group(1)) >= 2 and Path(said.group(2)).is_dir(), said.group(0)
    assert "hetpipe: error:" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.torch_matrix
def test_sigterm_to_every_process_of_the_job_saves_and_exits_0(tmp_path):
    # As Slurm preempts: the launcher, the server its ranks fork from, and the ranks all get it.
    run = tmp_path / "run"
    proc = start(run, "train.train_iters=100000", session=True)
    wait_for_steps(proc, run, 2)
    os.killpg(proc.pid, signal.SIGTERM)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, (code, out[-2000:], err[-3000:])
    said = re.search(r"^hetpipe: preempted by SIGTERM after step (\d+): checkpoint (\S+) saved; exiting 0$", out,
                     re.MULTILINE)
    assert said and Path(said.group(2)).is_dir(), (out[-2000:], err[-3000:])
    assert "hetpipe: error:" not in err and "Traceback" not in err, err[-3000:]


def test_a_stop_signal_the_ranks_do_not_take_for_preemption_ends_them_at_once(tmp_path):
    # Ranks forked from a server that ignores SIGTERM must act on it again: here it is no
    # preemption signal, so it ends them at once, not after the agent's 30 s before SIGKILL.
    run = tmp_path / "run"
    proc = start(run, "train.train_iters=100000", "train.preemption_signals=[SIGUSR1]", session=True)
    wait_for_steps(proc, run, 2)
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    code, out, err = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM and time.monotonic() - signalled < 15, (code, err[-3000:])
    assert "hetpipe: error: stopped by SIGTERM before the ranks saved" in err, err[-3000:]


# A frozen rank's peer times out after the deadline and finds the note its launcher
# keeps of the stopped rank (hetpipe/launch/frozen_ranks.py): it stops the job naming
# it at once and lingers 1 s after its line; the launcher then kills the stopped rank.
# Before, the peer blamed its own timeout after waiting 2 s plus half the deadline for
# a better cause, and the job ended past deadline + 5 s (torch's agent alone: 30 s more).
HANG_DEADLINE_S = 10


def test_a_frozen_rank_is_named_and_ends_the_job_within_its_deadline_and_5_s(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "train.train_iters=100000", f"cluster.transport.deadline_s={HANG_DEADLINE_S}",
                 fault="signal=SIGSTOP@step:rank=1:step=3", session=True)
    try:
        wait_for_steps(proc, run, 2)
        frozen = time.monotonic()  # within 0.1 s (the poll) of rank 1 stopping itself at step 3's start
        code, out, err = finish(proc, timeout=120)
        took = time.monotonic() - frozen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a stopped rank left over by a failure here
    print(f"exit {code} {took:.1f} s after rank 1 froze (deadline {HANG_DEADLINE_S} s)")
    assert code == 3, (code, out[-2000:], err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("hetpipe: error:")]
    assert len(errors) == 1, err[-3000:]
    assert re.fullmatch(r"hetpipe: error: \[rank 0\] rank 1 \(pid \d+\) stopped responding: its process has been "
                        r"stopped \(SIGSTOP, a debugger\) for \d+\.\d s", errors[0]), errors
    assert took < HANG_DEADLINE_S + 5, (took, err[-3000:])


def test_the_sbatch_script_waits_out_a_preemption_and_exits_with_its_steps(tmp_path):
    # Slurm sends SIGTERM to every process of a preempted job, the batch shell
    # included; bash's default would end the script (status 143) while the
    # steps still save. A fake srun stands for a node's launcher that saves
    # and exits 0 on SIGTERM.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/bash\ntrap "exit 0" TERM\ntouch {tmp_path}/started.$$\nsleep 60 &\nwait $!\nexit 7\n')
    srun.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path),
               SLURM_HET_SIZE="2", SLURM_JOB_ID="4242", PYTHON=sys.executable)
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm" / "hetpipe_hetjob.sbatch")], env=env,
                            cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    until = time.monotonic() + 30
    while len(list(tmp_path.glob("started.*"))) < 2:
        assert proc.poll() is None and time.monotonic() < until, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # as Slurm signals every process of the job
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (proc.returncode, out, err)
    assert not list(tmp_path.glob(".hetpipe-job-*")), "the job's secret was left behind"
