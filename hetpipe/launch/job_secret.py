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

**Only a random secret will do.** Anyone who reaches a rank's channel port
can start a handshake, or relay one between two ranks, and so obtain HMACs
under the secret of values it knows: an offline oracle, against which guesses
cost nothing and nobody sees them (``HETPIPE_JOB_TOKEN=hunter2`` was recovered
from a six-word list). A configured secret is therefore refused (one line,
exit 2) unless it can be shown to hold 128 bits - out of reach of any offline
search - and that can only be shown for a string of a known random alphabet:
at least 32 hexadecimal digits (``secrets.token_hex(16)``, ``openssl rand
-hex 16`` or longer), using both digits and letters (a string of digits
alone is a decimal number, 3.3 bits a digit: one secrets.token_hex(16) in
3.4 million is refused for it, token_hex(32) practically never), and without the runs, sequences
and repeats of a hand-made one (:func:`secret_problem`). Passwords and
passphrases are refused whatever their length: no rule can tell how much of
one is guessable.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import stat
from typing import Mapping, MutableMapping, Optional

from hetpipe.errors import ConfigError

ENV_TOKEN = "HETPIPE_JOB_TOKEN"
ENV_TOKEN_FILE = "HETPIPE_JOB_TOKEN_FILE"
# 256 bits when hetpipe draws the secret itself.
_DRAWN_BYTES = 32
# What an offline search of 2^128 guesses would need (NIST SP 800-57's
# strength for keys used past 2030); a configured secret must carry this
# much, counted as log2 of its alphabet per character (module docstring).
MIN_SECRET_BITS = 128
_HEX = re.compile(r"[0-9a-f]+")
# A secret some of whose characters a run, a sequence or a repeat explains
# was made by hand. Drawn at random, few are: of 500,000 secrets.token_hex(16)
# strings 88 % had none, 1.2 % two or more, none more than 5, each one more
# about ten times rarer - so 8 of 32 (a quarter) happens to no drawn secret.
_MAX_STRUCTURED_SHARE = 0.25
_HOW_TO_DRAW = "$(python -c 'import secrets; print(secrets.token_hex(32))')"


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
    check_secret_strength(token, env)
    return token


def provide_local_secret(env: MutableMapping[str, str]) -> None:
    """Before hetpipe's launcher spawns a one-machine job's ranks: check the configured
    secret, or, if there is none, put a fresh one into ``env`` for the children to inherit."""
    token = find_job_secret(env)
    if token is None:
        env[ENV_TOKEN] = secrets.token_hex(_DRAWN_BYTES)
    else:
        check_secret_strength(token, env)


def check_secret_strength(token: str, env: Mapping[str, str]) -> None:
    """One line (never the secret itself) for a configured secret too weak to be one."""
    problem = secret_problem(token)
    if problem is not None:
        source = ENV_TOKEN if env.get(ENV_TOKEN) else f"{ENV_TOKEN_FILE}={env.get(ENV_TOKEN_FILE)}"
        raise ConfigError(f"the job secret in {source} {problem}: anyone who reaches a channel port can test "
                          f"guesses of it offline; use {MIN_SECRET_BITS // 4} or more random hex digits, e.g. "
                          f"{_HOW_TO_DRAW}")


def secret_problem(token: str) -> Optional[str]:
    """Why ``token`` cannot be shown to hold :data:`MIN_SECRET_BITS` random bits, or None."""
    text = token.lower()
    if not _HEX.fullmatch(text):
        return f"is not hexadecimal ({len(token)} characters)"
    bits = secret_bits(text)
    if bits < MIN_SECRET_BITS:
        return f"holds at most {bits:.0f} bits ({len(text)} hex digits{_alphabet_note(text)})"
    if structured_characters(text) > _MAX_STRUCTURED_SHARE * len(text):
        return "has the runs, sequences or repeats of a hand-made string"
    return None


def secret_bits(text: str) -> float:
    """log2 of the alphabet ``text`` draws from (digits: 10, letters a-f: 6), per character."""
    alphabet = 10 * any(c.isdigit() for c in text) + 6 * any(not c.isdigit() for c in text)
    return len(text) * math.log2(alphabet)


def _alphabet_note(text: str) -> str:
    if text.isdigit():
        return ", digits only"
    return ", letters only" if not any(c.isdigit() for c in text) else ""


def structured_characters(text: str) -> int:
    """Characters of ``text`` that what precedes them explains: the third of a run
    (``aaa``), the fourth of three equal steps (``0123``, ``aceg``), or the last of
    four characters that appeared together before."""
    count = 0
    for i in range(len(text)):
        codes = [ord(c) for c in text[max(0, i - 3):i + 1]]
        run = i >= 2 and text[i] == text[i - 1] == text[i - 2]
        steps = i >= 3 and len({b - a for a, b in zip(codes, codes[1:])}) == 1
        repeat = i >= 4 and text[i - 3:i + 1] in text[:i]
        count += run or steps or repeat
    return count
