"""A job secret must be random: a guessable one is refused in one line, exit 2.

The handshake gives anyone who reaches a channel port HMACs under the secret
(an offline oracle), so ``HETPIPE_JOB_TOKEN=hunter2`` was recovered from a
six-word list while hetpipe only warned. The rule (hetpipe/launch/job_secret.py):
32 or more hex digits of digits and letters, without a hand-made string's runs,
sequences and repeats.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from conftest import REPO
from hetpipe.errors import ConfigError
from hetpipe.launch.job_secret import provide_local_secret, require_job_secret
from hetpipe.launch.scheduler_env import check_job_token

WEAK = {
    "hunter2": "is not hexadecimal",
    "correcthorsebatterystaple": "is not hexadecimal",  # dictionary words
    "Tr0ub4dor&3-and-a-much-longer-tail-of-words": "is not hexadecimal",
    "0a1b2c3d4e5f": "holds at most 48 bits",  # short
    "7" * 64: "runs, sequences or repeats",  # a long run of one character
    "deadbeef" * 8: "runs, sequences or repeats",  # a word repeated
    "0123456789abcdef" * 2: "runs, sequences or repeats",
    "31415926535897932384626433832795": "holds at most 106 bits",  # digits only: a decimal number
    "facadedecadebeadedcafebabeaddedbedfeed": "holds at most 98 bits",  # hex letters only: words
}


@pytest.mark.parametrize("token", list(WEAK))
def test_a_guessable_secret_is_refused_in_one_line_that_never_shows_it(token):
    with pytest.raises(ConfigError) as info:
        require_job_secret({"HETPIPE_JOB_TOKEN": token})
    message = str(info.value)
    assert "\n" not in message and token not in message
    assert message.startswith("the job secret in HETPIPE_JOB_TOKEN ") and WEAK[token] in message, message
    assert "secrets.token_hex(32)" in message
    with pytest.raises(ConfigError):
        provide_local_secret({"HETPIPE_JOB_TOKEN": token})  # the local launcher, before any rank starts
    with pytest.raises(ConfigError):
        check_job_token({"HETPIPE_JOB_TOKEN": token}, nnodes=1)  # launch_cluster.sh, on every node


def test_every_drawn_secret_passes_and_a_file_is_checked_like_the_variable(tmp_path):
    from hetpipe.launch.job_secret import secret_problem

    drawn = [secrets.token_hex(16) for _ in range(3000)] + [secrets.token_hex(32) for _ in range(300)]
    assert [t for t in drawn if secret_problem(t) is not None] == []
    assert require_job_secret({"HETPIPE_JOB_TOKEN": drawn[0].upper()}) == drawn[0].upper()
    path = tmp_path / "token"
    path.write_text("hunter2hunter2\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=f"^the job secret in HETPIPE_JOB_TOKEN_FILE={path} is not hexadecimal"):
        require_job_secret({"HETPIPE_JOB_TOKEN_FILE": str(path)})


@pytest.mark.timeout(120)
def test_the_launcher_refuses_a_weak_secret_before_any_rank_starts(tmp_path):
    env = dict(os.environ, HETPIPE_JOB_TOKEN="hunter2", PYTHONUNBUFFERED="1")
    env.pop("HETPIPE_JOB_TOKEN_FILE", None)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hetpipe.pretrain", "+model=tiny_llama", "cluster=cpu_mixed",
                           "data=demo", "train.train_iters=1", "train.seq_length=32", "train.global_batch_size=8",
                           "train.micro_batch_size=2", "model.hidden_size=64", "model.ffn_hidden_size=160",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=110)
    took = time.monotonic() - began
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-3000:])
    assert proc.stderr.strip().splitlines() == [
        "hetpipe: error: the job secret in HETPIPE_JOB_TOKEN is not hexadecimal (7 characters): anyone who "
        "reaches a channel port can test guesses of it offline; use 32 or more random hex digits, e.g. "
        "$(python -c 'import secrets; print(secrets.token_hex(32))')"], proc.stderr[-3000:]
    assert "step" not in proc.stdout and not (tmp_path / "metrics.jsonl").exists()
    print(f"refused in {took:.1f} s")
