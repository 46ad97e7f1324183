"""The pipeline's action set: what one rank can do in a step.

A rank forwards (F) or backwards (B, or B split into BWD_INPUT and
BWD_WEIGHT) one microbatch on one of its model chunks, and sends or receives
what a neighbouring virtual stage needs. Schedules (:mod:`hetpipe.pipeline.schedules`)
order these actions, the simulator (:mod:`hetpipe.pipeline.schedule_check`) proves an
order correct and the engine (:mod:`hetpipe.training.engine`) runs it; this module is
only their shared vocabulary, so that a schedule generator of its own module
(:mod:`hetpipe.pipeline.schedule_zbv`) needs nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

FWD, BWD = "fwd", "bwd"
# Zero-bubble split backward (Qi et al., "Zero Bubble Pipeline Parallelism",
# ICLR 2024): BWD_INPUT ("B" in the paper) is the gradient with respect to
# the unit's input, which the previous stage waits for; BWD_WEIGHT ("W") the
# weight gradients, which nobody waits for and so can fill a bubble. A unit
# has either one BWD or one BWD_INPUT followed, later, by its BWD_WEIGHT.
BWD_INPUT, BWD_WEIGHT = "bwd_input", "bwd_weight"
SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD = "send_fwd", "recv_fwd", "send_bwd", "recv_bwd"
ACTION_KINDS = (RECV_FWD, FWD, SEND_FWD, RECV_BWD, BWD, BWD_INPUT, BWD_WEIGHT, SEND_BWD)
COMPUTE_KINDS = (FWD, BWD, BWD_INPUT, BWD_WEIGHT)

# (fwd|bwd, microbatch, chunk): one computation on one rank.
Compute = tuple[str, int, int]


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    ``chunk`` is the model chunk on this rank that computes, or whose
    activations/gradients are sent or received; ``peer`` is the rank on the
    other end of a send or receive and ``None`` for computations.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        letter = {FWD: "F", BWD: "B", BWD_INPUT: "Bi", BWD_WEIGHT: "W", SEND_FWD: "F", RECV_FWD: "F"}
        unit = f"{letter.get(self.kind, 'B')}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")
        if self.kind.startswith("send_"):
            return f"send{unit}->{self.peer}"
        if self.kind.startswith("recv_"):
            return f"recv{unit}<-{self.peer}"
        return unit
