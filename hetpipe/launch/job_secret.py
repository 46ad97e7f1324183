"""Where a job's shared secret comes from, and where it must never come from.

The socket channels' handshake (:mod:`hetpipe.comm.handshake`) proves on both
sides of every connection that the peer holds the job secret. That proof is
only as good as the secret's source: torch's TCPStore takes no credentials
and lists its keys, so a secret drawn by rank 0 and shared through the store
(what hetpipe once did) is a secret every process that reaches the store can
read. The secret therefore comes, in this order, from:

1. ``HETPIPE_JOB_TOKEN`` in the launcher's environment (the same value on
   every node: a scheduler secret, ``scripts/launch_cluster.sh``);
2. the file named by ``HETPIPE_JOB_TOKEN_FILE``, which must be a regular file
   that group and others cannot read (a Kubernetes secret mounted 0400);
3. for a one-machine job started by hetpipe's own launcher
   (:func:`hetpipe.launch.local.launch`), a fresh random secret that the launcher
   hands its child ranks through their environment.

A job started any other way (``torchrun``, on one machine or many) without
one of the first two fails at once with one line saying what to set.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from typing import Mapping, MutableMapping

from hetpipe.errors import ConfigError

ENV_TOKEN = "HETPIPE_JOB_TOKEN"
ENV_TOKEN_FILE = "HETPIPE_JOB_TOKEN_FILE"
# Anyone who reaches a listening port gets one HMAC under the secret per
# connection and can test guesses offline, so the secret must be random, not
# a password: 256 bits when hetpipe draws it, and a warning below 128 bits' worth of hex.
_DRAWN_BYTES = 32
_WEAK_BELOW_CHARS = 32

log = logging.getLogger(__name__)


def read_token_file(path: str) -> str:
    """The job secret in ``path``, which only its owner may read or write."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{ENV_TOKEN_FILE}={path} is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(f"{ENV_TOKEN_FILE}={path} is open to group or others "
                              f"(mode {stat.S_IMODE(info.st_mode):04o}): chmod 600 it")
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"{ENV_TOKEN_FILE}={path} cannot be read: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"{ENV_TOKEN_FILE}={path} is empty")
    return token


def find_job_secret(env: Mapping[str, str]) -> str | None:
    """The secret from ``HETPIPE_JOB_TOKEN`` or ``HETPIPE_JOB_TOKEN_FILE``; None if neither is set."""
    if env.get(ENV_TOKEN):
        return env[ENV_TOKEN]
    if env.get(ENV_TOKEN_FILE):
        return read_token_file(env[ENV_TOKEN_FILE])
    return None


def require_job_secret(env: Mapping[str, str]) -> str:
    """The job secret for a rank whose job has socket-channel boundaries; one line if there is none."""
    token = find_job_secret(env)
    if token is None:
        raise ConfigError(
            f"no job secret: set {ENV_TOKEN} (the same random value on every rank, e.g. "
            f"$(python -c 'import secrets; print(secrets.token_hex(32))')) or {ENV_TOKEN_FILE} (a file only "
            "you can read); it authenticates the cross-vendor channels and is never taken from the store")
    if len(token) < _WEAK_BELOW_CHARS:
        log.warning("the job secret is only %d characters: anyone who reaches a rank's channel port can test "
                    "guesses of it offline; use secrets.token_hex(32)", len(token))
    return token


def provide_local_secret(env: MutableMapping[str, str]) -> None:
    """Before hetpipe's launcher spawns a one-machine job's ranks: check the configured
    secret, or, if there is none, put a fresh one into ``env`` for the children to inherit."""
    if find_job_secret(env) is None:
        env[ENV_TOKEN] = secrets.token_hex(_DRAWN_BYTES)
