"""Injected faults, for tests of what a job does when things go wrong.

``HETPIPE_FAULT`` holds ``;``-separated faults, each
``<action>@<point>[:rank=R][:step=S][:attempt=A]``:

* actions: ``kill`` (SIGKILL this process: no handler, no cleanup, as the
  kernel's OOM killer or a dead node does), ``raise`` (a RuntimeError, i.e. a
  bug), ``oom`` (torch's OutOfMemoryError, as a device allocation that
  failed raises it, so that the out-of-memory path of hetpipe.training.memory_fit
  runs on CPU too), ``nan`` (the point's tensors become +inf), ``sleep=<seconds>``
  (a slow rank), ``signal=<NAME>`` (send this process a signal, as a
  scheduler would);
* points: ``step`` (a training step's start), ``grads`` (a step's gradients
  are complete, before the clip and the finite check), ``save`` (a
  checkpoint's background write, after this rank's first file);
* ``rank``/``step`` restrict it to one global rank / 1-based optimizer step;
  ``attempt`` to one restart attempt of the job (default 0, the first, so
  a restarted job does not die again the same way; ``attempt=any`` always).

Unset (the normal case) every check is one dictionary lookup. Nothing here is
configuration a user sets: an unknown action or point is refused so that a
test with a typo fails instead of passing without its fault.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from hetpipe.errors import ConfigError
from hetpipe.process.rank_env import restart_attempt

ENV = "HETPIPE_FAULT"
POINTS = ("step", "grads", "save")
ACTIONS = ("kill", "raise", "oom", "nan", "sleep", "signal")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    argument: Optional[str] = None
    rank: Optional[int] = None
    step: Optional[int] = None
    attempt: Optional[int] = 0  # None: every attempt

    def matches(self, point: str, rank: int, step: Optional[int]) -> bool:
        return (self.point == point and (self.rank is None or self.rank == rank)
                and (self.step is None or self.step == step)
                and (self.attempt is None or self.attempt == restart_attempt()))


def parse(text: str) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        head, *fields = spec.split(":")
        action, _, point = head.partition("@")
        action, _, argument = action.partition("=")
        if action not in ACTIONS or point not in POINTS:
            raise ConfigError(f"{ENV}: {spec!r} is not <action>@<point> with an action of "
                              f"{', '.join(ACTIONS)} and a point of {', '.join(POINTS)}")
        kwargs: dict = {}
        for item in fields:
            key, _, value = item.partition("=")
            if key not in ("rank", "step", "attempt") or not value:
                raise ConfigError(f"{ENV}: {spec!r} has {item!r}; expected rank=, step= or attempt=")
            kwargs[key] = None if key == "attempt" and value == "any" else int(value)
        faults.append(Fault(action, point, argument or None, **kwargs))
    return faults


_parsed: Optional[tuple[str, list[Fault]]] = None


def _faults() -> list[Fault]:
    global _parsed
    text = os.environ.get(ENV, "")
    if _parsed is None or _parsed[0] != text:
        _parsed = (text, parse(text))
    return _parsed[1]


def hit(point: str, rank: int, step: Optional[int] = None,
        tensors: Callable[[], Iterable[Optional[torch.Tensor]]] = tuple) -> None:
    """Carry out the faults set for ``point`` on ``rank`` at ``step``, if any.
    ``tensors`` gives the point's tensors (for ``nan``); it is called only then."""
    if ENV not in os.environ:
        return
    for fault in _faults():
        if not fault.matches(point, rank, step):
            continue
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is delivered before this returns
        elif fault.action == "raise":
            raise RuntimeError(f"injected fault at {point} of step {step} on rank {rank}")
        elif fault.action == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory fault at {point} of step {step} on rank {rank}")
        elif fault.action == "nan":
            with torch.no_grad():
                for t in tensors():
                    if t is not None:
                        t.fill_(float("inf"))
        elif fault.action == "sleep":
            time.sleep(float(fault.argument or 1.0))
        elif fault.action == "signal":
            os.kill(os.getpid(), getattr(signal, fault.argument or "SIGTERM"))
