"""An open-file limit too low to run is one line and exit 2; one the hard limit can lift is lifted.

Before hetpipe checked (hetpipe/launch/fd_limit.py), ``ulimit -n`` 32 or 16
ended the two-rank launcher in a traceback (EMFILE from a pipe or torch's
store server) and 24 stalled in torch's rendezvous retries for a minute.
"""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(180)

TINY = ["+model=tiny_llama", "cluster=cpu_mixed", "data=demo", "model.hidden_size=64", "model.ffn_hidden_size=160",
        "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "logging.progress=false",
        "train.train_iters=1"]
LINE = re.compile(r"hetpipe: error: the open-file limit is (\d+) \(hard (\d+)\) but the launcher of 2 local ranks "
                  r"needs about (\d+) descriptors: run with a higher one, e.g. `ulimit -n (\d+)` before the command "
                  r"\(above the hard limit only root or limits.conf can\)")


def pretrain_under(ulimit: str, run_dir) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m hetpipe.pretrain`` started by a shell after ``ulimit <ulimit>``, as a user would."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = " ".join([f"ulimit {ulimit} &&", "exec", sys.executable, "-m", "hetpipe.pretrain", *TINY,
                        f"hydra.run.dir={run_dir}"])
    began = time.monotonic()
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, text=True, capture_output=True, timeout=150)
    return proc, time.monotonic() - began


@pytest.mark.parametrize("limit", [16, 24, 32])
def test_a_limit_too_low_for_the_job_is_one_line_and_exit_2(tmp_path, limit):
    proc, took = pretrain_under(f"-Sn {limit} -Hn {limit}", tmp_path)
    print(f"ulimit -n {limit}: exit {proc.returncode} in {took:.1f} s")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), proc.stderr[-3000:]
    soft, hard, need, advice = map(int, LINE.fullmatch(lines[0]).groups())
    assert soft == hard == limit and need == advice > limit
    assert took < 60, took  # the stall at 24 lasted torch's 60 s rendezvous timeout


def test_a_low_soft_limit_under_a_high_hard_one_is_raised_and_the_job_runs(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard open-file limit here is {hard}")
    proc, took = pretrain_under("-Sn 24", tmp_path)
    print(f"ulimit -Sn 24 (hard {hard}): exit {proc.returncode} in {took:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step      1/1" in proc.stdout and "hetpipe: error" not in proc.stderr


def test_a_rank_whose_limit_is_too_low_says_so_in_one_line():
    # Under torchrun each rank checks its own need (more ranks in the job than
    # on its node need more than its launcher does).
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40)); "
            "from hetpipe.launch.fd_limit import Need; from hetpipe.launch.local import _worker; "
            "_worker(print, ('trained',), fds=Need(63, 'each rank of 16 (1 connection to each neighbour)'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 2 and "trained" not in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "hetpipe: error: [rank 0] the open-file limit is 40 (hard 40) but each rank of 16 (1 connection to each neighbour) "
        "needs about 63 descriptors: run with a higher one, e.g. `ulimit -n 63` before the command (above the "
        "hard limit only root or limits.conf can)"]
