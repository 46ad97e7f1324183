"""User-facing errors.

Anything a user can cause (a bad config value, a missing data file, a corrupt
index) raises :class:`HetpipeError` with one sentence that names the problem.
Entry points catch it, print that one line and exit non-zero, so users never
have to read a traceback to learn that a path was wrong.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")


# Exit statuses a user (or a scheduler's requeue rule) can tell apart: bad
# input is the user's to fix and retrying cannot help; a lost node, link or
# peer is the cluster's, and a restart may succeed; a crashed rank (killed by
# a signal - SIGKILL from the OOM killer or a user, SIGSEGV - or an exception
# that is a bug) is the code's or the machine's, and the launcher names the
# rank and how it died. A device that ran out of memory is the plan's: a
# restart would run out again at the same step, so the launcher does not
# restart it (hetpipe/launch/agent.py). A launcher stopped by a signal exits 128 + its
# number (0 when preempted: every rank saved a checkpoint first).
EXIT_CRASH = 1
EXIT_BAD_INPUT = 2
EXIT_LOST_PEER = 3
EXIT_OUT_OF_MEMORY = 4


class HetpipeError(Exception):
    """An error caused by input (config, data, checkpoint, peer), not by a bug."""

    # The status a process ends with for it (one of the EXIT_ statuses above).
    exit_status = EXIT_BAD_INPUT


class ConfigError(HetpipeError):
    """A configuration value is missing, of the wrong kind, or out of range."""


class DataError(HetpipeError):
    """A data file or tokenizer is missing, malformed or inconsistent."""


class OutOfDeviceMemory(HetpipeError):
    """A rank's device ran out of memory (torch's OutOfMemoryError, in one line: hetpipe.training.memory_fit)."""

    exit_status = EXIT_OUT_OF_MEMORY


def config_error_from(exc: Exception, prefix: str = "") -> HetpipeError:
    """The one error to show for ``exc``, raised while OmegaConf built config
    objects: OmegaConf wraps what a ``__post_init__`` raised, so that
    HetpipeError is dug out; anything else becomes its first line."""
    if isinstance(exc, HetpipeError):
        return exc
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, HetpipeError):
        return cause
    return ConfigError(prefix + str(exc).splitlines()[0])


def error_line(message: str) -> None:
    """Write ``hetpipe: error: <message>`` to stderr in one system call: ranks
    of a job share their launcher's stderr, and a print split into text and
    newline let two ranks' lines run together on one line (seen in CI-like
    runs). One write of less than PIPE_BUF bytes to a pipe is atomic."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"hetpipe: error: {message}\n".encode())


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``hetpipe: error: <message>`` on stderr and exit with ``code``."""
    error_line(message)
    raise SystemExit(code)


def run_hydra_cli(main: Callable[[], None]) -> None:
    """Run a ``@hydra.main`` entry point: a command line hydra cannot compose - an
    unknown key, a value of the wrong type, a config group option that does not
    exist - is one line and exit 2 like any bad input, instead of hydra's
    multi-line report and exit 1, with the closest name where one was misspelt.
    Flags hydra does not take (Megatron-LM's and torchtitan's, typos) are answered
    in one line before hydra parses them (hetpipe.errors.foreign_flags).
    ``HYDRA_FULL_ERROR=1`` keeps hydra's own report."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    from hydra.errors import HydraException

    from hetpipe.errors.foreign_flags import foreign_flags_line

    line = foreign_flags_line(sys.argv[1:])
    if line is not None:
        fail(line)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # hydra raises instead of reporting; reported here
    try:
        main()
    except HydraException as exc:
        fail(f"bad command line: {hydra_error_line(exc)}")
    except Exception:  # noqa: BLE001 - a bug: its traceback, as hydra would print it
        traceback.print_exc()
        raise SystemExit(EXIT_CRASH) from None


def hydra_error_line(exc: Exception) -> str:
    """Hydra's report of a composition error in one line: its first line, the
    OmegaConf error behind it, and a config group's options; a misspelt key or
    option gets the closest name, a group added without ``+`` the fix."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = lines[0].rstrip(".") if lines else type(exc).__name__
    if len(lines) > 1 and "No match in the defaults list" in lines[0] and "use +" in lines[1]:
        fix = lines[1].split("use ", 1)[1]
        return f"{fix[1:]}: {fix[1:].split('=')[0]} has no default to override; add it with a +: {fix}"
    if exc.__cause__ is not None and str(exc.__cause__).strip():
        line += ": " + str(exc.__cause__).strip().splitlines()[0] + _key_hint(exc.__cause__, lines[0])
    if any(l.startswith("Available options") for l in lines):
        start = next(i for i, l in enumerate(lines) if l.startswith("Available options")) + 1
        options = [l for l in lines[start:] if not l.startswith(("Config search path", "provider="))]
        options = options[:next((i for i, l in enumerate(options) if ":" in l), len(options))]
        line += _option_hint(lines[0], options) + f" (available: {', '.join(options)})"
    return line


def _key_hint(cause: BaseException, first_line: str) -> str:
    """" (did you mean train.train_iters?)" for a key the schema (a dataclass) lacks."""
    from hetpipe.errors.suggest import did_you_mean

    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    if not isinstance(key, str) or not dataclasses.is_dataclass(schema) or "not in" not in str(cause):
        return ""
    typed = first_line.split("'")[1] if first_line.count("'") >= 2 else key
    prefix = typed[:-len(key)] if typed.endswith(key) else ""
    return did_you_mean(key, [f.name for f in dataclasses.fields(schema)], prefix + "{}")


def _option_hint(first_line: str, options: list[str]) -> str:
    """" (did you mean +model=llama8b?)" for an option of a group that does not exist."""
    from hetpipe.errors.suggest import did_you_mean

    wanted = first_line.split("'")[-2] if first_line.count("'") >= 2 else ""
    group, _, option = wanted.rpartition("/")
    plus = "+" if group == "model" else ""
    return did_you_mean(option, options, f"{plus}{group}={{}}") if group else ""


def run_cli(fn: Callable[[], T]) -> T:
    """Run ``fn``; turn a :class:`HetpipeError` into one line and its exit status (2: bad input)."""
    try:
        return fn()
    except HetpipeError as exc:
        fail(str(exc), exc.exit_status)
