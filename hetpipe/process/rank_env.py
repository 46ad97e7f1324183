"""This process's place in a launch, as its launcher's environment states it.

Whoever started the process - torchrun, hetpipe's local launcher, nobody -
says so through variables: RANK / WORLD_SIZE / LOCAL_RANK, and the restart
attempt. Everything that needs these facts (the local launcher, the job's
watch, checkpoints' store keys, injected faults, the doctor) reads them here,
so this module imports nothing of hetpipe and everything may import it: it is
what keeps the launcher, the watch and the checkpoint saver out of each
other's imports.
"""
from __future__ import annotations

import os

# Set by hetpipe's agent for each attempt (hetpipe.launch.agent); read by restart_attempt.
ATTEMPT_ENV = "HETPIPE_ATTEMPT"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def restart_attempt() -> int:
    """Which run of the job this process belongs to: 0, then 1 after the first restart...

    The same on every node: hetpipe's launchers set ``HETPIPE_ATTEMPT`` from the
    rendezvous round (hetpipe/launch/agent.py says why torch's
    ``TORCHELASTIC_RESTART_COUNT`` is not); under a plain torchrun that count.
    """
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process (0, 1, 0 outside a launcher)."""
    if under_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return 0, 1, 0
