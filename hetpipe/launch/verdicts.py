"""The job's verdict - the one cause, and exit status, every rank stops with - sealed in its store.

A rank, or a launcher that saw one of its ranks die, posts the verdict once
under :data:`ABORT_KEY` of the attempt's :func:`namespace` (first post wins,
``compare_set``); every rank's watch reads it (:mod:`hetpipe.launch.job_watch`).
The value is sealed with the job secret (:mod:`hetpipe.launch.store_seal`),
and only a status hetpipe posts is taken (:data:`VERDICT_CODES`; 0 never
is: a job ends 0 by finishing). A value that fails either check is ignored,
with one warning line per node, and a rank that posts its own cause puts it
in that value's place.

The launcher (:mod:`hetpipe.launch.agent`) calls :func:`post_verdict` and
:func:`posted_verdict` with a store client of its own; each request is
bounded by that client's timeout (:func:`hetpipe.launch.store_calls.call_within`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple, Optional

from hetpipe.errors import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_LOST_PEER, EXIT_OUT_OF_MEMORY, ConfigError
from hetpipe.launch.job_secret import ENV_TOKEN, ENV_TOKEN_FILE, find_job_secret, require_job_secret
from hetpipe.launch.preemption import marker_dir
from hetpipe.process.rank_env import restart_attempt
from hetpipe.launch.store_calls import call_within
from hetpipe.launch.store_seal import Seal, Unsealed

ABORT_KEY = "hetpipe/abort"
# The statuses a verdict may end ranks with: those hetpipe's ranks and
# launchers post (hetpipe/errors/__init__.py). Not 0: a forged 0 once ended both ranks
# of a run at step 7 of 40 without a result, and its launcher never exited.
VERDICT_CODES = frozenset((EXIT_CRASH, EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_OUT_OF_MEMORY))
# A forged value in the key is replaced by a rank's own verdict
# (compare_set against it); a writer that keeps replacing it can only make
# the rank give up after this many rounds and end with its own cause.
_POST_TRIES = 4
# How much of an ignored value its warning shows.
_SHOWN_BYTES = 80

_warned: set[str] = set()  # keys whose ignored value this process reported


class Verdict(NamedTuple):
    """The job's one reason to stop, and the exit status every rank gives it."""
    reason: str
    code: int


def namespace(attempt: Optional[int] = None) -> str:
    """The prefix of every key this attempt of the job writes to the rendezvous store."""
    return f"hetpipe/attempt{restart_attempt() if attempt is None else attempt}"


def job_seal(attempt: Optional[int] = None) -> Seal:
    """The seal of this process's job secret for ``attempt`` (default: this process's);
    one line (exit 2) when there is no secret. Every job of more than one rank has
    verdicts, so every such job needs the secret, whether or not a channel does."""
    if find_job_secret(os.environ) is None:
        raise ConfigError(
            f"no job secret: set {ENV_TOKEN} (the same random value on every rank, e.g. $(python -c 'import "
            f"secrets; print(secrets.token_hex(32))')) or {ENV_TOKEN_FILE} (a file only you can read); it seals "
            "the job's stop verdicts in its store and authenticates the cross-vendor channels (hetpipe's own "
            "launcher draws one for a job on one host)")
    secret = require_job_secret(os.environ)  # its checks of a secret that is set
    return Seal(secret, restart_attempt() if attempt is None else attempt)


def encode(seal: Seal, rank: int, reason: str, code: int) -> str:
    """The sealed value of a verdict posted now by ``rank``."""
    if code not in VERDICT_CODES:
        raise ValueError(f"{code} is not a verdict's status (one of {sorted(VERDICT_CODES)})")
    return seal.seal(ABORT_KEY, {"rank": rank, "reason": reason, "code": code, "time": time.time()})


def decode(seal: Seal, raw: bytes, who: str) -> Optional[tuple[Verdict, float]]:
    """The verdict ``raw`` holds and when it was posted, or None (with a warning, once)
    if it is not a sealed verdict of this job and attempt. ``who`` starts the warning."""
    try:
        body = seal.open(ABORT_KEY, raw)
        return _checked(body), float(body["time"])
    except Unsealed as exc:
        _ignored(seal.attempt, raw, str(exc), who)
        return None


def _checked(body: dict[str, Any]) -> Verdict:
    reason, code = body.get("reason"), body.get("code")
    if not isinstance(reason, str) or type(code) is not int or not isinstance(body.get("time"), (int, float)):
        raise Unsealed("it is not a verdict")
    if code not in VERDICT_CODES:
        raise Unsealed(f"its status {code} is not one a verdict may have")
    return Verdict(reason, code)


def post_in(client: Any, seal: Seal, rank: int, reason: str, code: int, who: str) -> tuple[Verdict, float]:
    """Post a verdict through ``client`` (under the attempt's namespace) unless a sealed one
    stands; the verdict that stands, and when it was posted. A value that is not sealed
    gives way to this one."""
    value = encode(seal, rank, reason, code)
    expected: bytes = b""
    for _ in range(_POST_TRIES):
        raw = client.compare_set(ABORT_KEY, expected, value)
        if raw == value.encode():
            return Verdict(reason, code), time.time()
        standing = decode(seal, raw, who)
        if standing is not None:
            return standing
        expected = b"" if raw == expected else raw  # the key vanished meanwhile: post into an empty one
    return Verdict(reason, code), time.time()


def read_in(client: Any, seal: Seal, who: str) -> Optional[Verdict]:
    """The sealed verdict posted through ``client``, if any."""
    if not client.check([ABORT_KEY]):
        return None
    standing = decode(seal, client.get(ABORT_KEY), who)
    return None if standing is None else standing[0]


# -- the launcher's calls (hetpipe/launch/agent.py) -------------------------------------
def post_verdict(store: Any, rank: int, reason: str, code: int,
                 attempt: Optional[int] = None) -> tuple[Verdict, float]:
    """Post ``reason`` (ending ranks with ``code``) in ``store`` (already under
    :func:`namespace`) for ``attempt`` unless a verdict is there already; returns the one
    that stands, and when it was posted (its poster's ``time.time()``)."""
    seal = job_seal(attempt)
    return call_within(lambda: post_in(store, seal, rank, reason, code, "launcher: "), *_bounds(store))


def posted_verdict(store: Any, attempt: Optional[int] = None) -> Optional[Verdict]:
    """The verdict posted in ``store`` (already under :func:`namespace`) for ``attempt``, if any."""
    seal = job_seal(attempt)
    return call_within(lambda: read_in(store, seal, "launcher: "), *_bounds(store))


def _bounds(store: Any) -> tuple[float, str]:
    """The client's own timeout, and where its store is (``host:port``)."""
    base = store
    while not hasattr(base, "host") and hasattr(base, "underlying_store"):
        base = base.underlying_store
    where = f"{base.host}:{base.port}" if hasattr(base, "host") else "?"
    return store.timeout.total_seconds(), where


# -- lines a node says once ----------------------------------------------------------
def first_on_node(name: str) -> bool:
    """Whether no other process of this node's launch has taken ``name`` yet.

    The first takes it by creating a file of that name in its attempt's launch
    directory; the others find it there. Without a launch directory (a rank
    run by hand) every process takes it.
    """
    directory = marker_dir(restart_attempt())
    if directory is None:
        return True
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _ignored(attempt: int, raw: bytes, why: str, who: str) -> None:
    """One warning per node for the first value under the key that is not sealed by the job."""
    key = f"{namespace(attempt)}/{ABORT_KEY}"
    if key in _warned:
        return
    _warned.add(key)
    if not first_on_node(f"ignored-{key.replace('/', '_')}"):
        return
    shown = raw[:_SHOWN_BYTES] + (b"..." if len(raw) > _SHOWN_BYTES else b"")
    line = (f"hetpipe: warning: {who}ignored a value of {key} in the job's store: {why} ({shown!r}); "
            "someone other than the job wrote it, and further ones are ignored without a line\n")
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), line.encode(errors="replace"))
