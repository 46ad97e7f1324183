"""The ``python`` a script gets from :func:`cli_zygote.python_shim`: ``-m MODULE ARGS``
(or ``SCRIPT ARGS``) runs as a fork of the pytest worker's zygote, with this process's
standard streams, environment, working directory and namespaces (an emulated node's network and /sys),
and this process stands for it: signals sent here go to the command, and it exits
as the command did. Anything else, or a command the zygote cannot mirror, execs the
interpreter itself. Standard library only: this starts without site-packages."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

# Signals a script or a test may send the command's process (the rest stop this one).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(path: str, python: str, script_only: list[str], argv: list[str]) -> None:
    if argv[:1] == ["-u"] and os.environ.get("PYTHONUNBUFFERED"):
        argv = argv[1:]  # what the environment asks already (torchrun starts its workers `python -u -m ...`)
    if argv[:1] == ["-m"] and len(argv) > 1:
        command = {"module": argv[1], "args": argv[2:]}
    elif argv and not argv[0].startswith("-") and os.path.isfile(argv[0]):
        command = {"script": argv[0], "args": argv[1:]}
    else:  # an option of the interpreter's own, or no such script: as it says
        os.execv(python, [python, *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:  # the worker's zygote is gone
        os.execv(python, [python, *argv])
    namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in ("net", "mnt")]
    request = {**command, "env": dict(os.environ), "cwd": os.getcwd(), "script_only": script_only}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *namespaces])
    reply = json.loads(conn.recv(1 << 16) or b'{"fresh": ["the zygote ended"]}')
    if "fresh" in reply:
        os.execv(python, [python, *argv])
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: _forward(reply["pid"], signum))
    ended = conn.recv(1 << 16)
    status = json.loads(ended)["status"] if ended else 1
    if status < 0:  # killed by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
