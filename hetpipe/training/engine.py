"""Runs one pipeline rank's action list for one optimizer step, or a
forward-only list for validation.

The engine is transport-agnostic: it sees each neighbouring stage as a
:class:`hetpipe.comm.stage_link.StageLink` and does not know which ranks stand
behind it or whether NCCL, the TCP CPU-forwarding channel or gloo carries the
bytes. Receives are posted ahead (``recv_ahead`` outstanding, in action-list
order, which is the FIFO order the channels match on) so transfers overlap
compute; sends are asynchronous and only waited for at the end of the step.
With one stage and no links the same engine is the single-process trainer,
which is what makes pipelined and single-process runs comparable bit for bit.
Every chunk gets its microbatch's (host) tokens beside its input, as the last
gets its labels: a chunk that masks documents reads their boundaries from them
(hetpipe.models.documents), so no boundary carries them.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from hetpipe.models import CausalLM
from hetpipe.models.split_backward import WeightBackward, backward_input, capture_output
from hetpipe.models.precision import WORKING_COPY_MODES, Bf16Weights, compute_context
from hetpipe.pipeline.actions import (
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    FWD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    Action,
)

if TYPE_CHECKING:
    from hetpipe.comm.channel import Handle
    from hetpipe.comm.stage_link import StageLink

# What a receive carries: activations (fwd) or gradients (bwd), the channels' message kinds.
_DIRECTION = {RECV_FWD: FWD, RECV_BWD: BWD}


@dataclass
class _Step:
    """One :meth:`PipelineEngine.run_step`'s (or ``run_forward``'s) state, which
    its handlers share.

    Tensors are keyed (microbatch, chunk), received ones (kind, microbatch,
    chunk); ``recvs`` are the step's receives in list order, the first
    ``next_recv`` of them posted and ``done_recvs`` waited for.
    """

    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    recvs: list[Action]
    # Each microbatch's loss weight (hetpipe.training.token_loss), on the device; None: no weights.
    loss_weights: Optional[torch.Tensor] = None
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    embedded: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # first stage, split backward: B's end
    weight_backwards: dict[tuple[int, int], WeightBackward] = field(default_factory=dict)
    posted: dict[tuple[str, int, int], tuple[torch.Tensor, "Handle"]] = field(default_factory=dict)
    sends: list["Handle"] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    # The last forward's output or backward's root, held until the next
    # forward returns or the next backward starts, as the step loop's ``out``
    # variable held it: a B's graph outlives its W by that long, which the
    # planner's memory model counts (partitioner/schedule_model.memory_rows)
    # and tests/test_partitioner_schedules.py measures.
    out: Optional[torch.Tensor] = None
    next_recv: int = 0
    done_recvs: int = 0
    waited: float = 0.0


def _loss_root(loss: torch.Tensor, step: _Step, microbatch: int) -> torch.Tensor:
    """What a microbatch's backward starts from: its loss over the number of
    microbatches (a single-process step's scaling), times its weight if it has one."""
    root = loss if step.loss_weights is None else loss * step.loss_weights[microbatch]
    return root / len(step.microbatches)


def _weighted(loss: torch.Tensor, step: _Step, microbatch: int) -> torch.Tensor:
    """A microbatch's share of the step's loss sum: its loss times its weight;
    0 for weight 0 (a microbatch without a token that counts has a NaN mean)."""
    if step.loss_weights is None:
        return loss
    weight = step.loss_weights[microbatch]
    return torch.where(weight == 0, torch.zeros_like(loss), loss * weight)


class PipelineEngine:
    def __init__(self, chunks: Sequence[CausalLM], actions: Sequence[Action], links: dict[int, StageLink],
                 rank: int, pipeline_size: int, activation_shape: tuple[int, ...],
                 activation_dtype: torch.dtype, device: torch.device, precision: str = "fp32",
                 weights: Optional[Bf16Weights] = None, recv_ahead: int = 2) -> None:
        self.chunks = list(chunks)
        self.actions = list(actions)
        self.links = links  # neighbouring stage index -> its link
        self.rank = rank
        self.pipeline_size = pipeline_size
        # Consecutive virtual stages on this rank (the turn of a V placement,
        # hetpipe.pipeline.placement; several chunks on one rank) hand their tensors
        # over in-process, with no message. Every stage holds units, so two
        # chunks are consecutive exactly when their unit ranges meet: the
        # chunks say it, whatever placement built them.
        starts = {chunk.unit_range[0]: c for c, chunk in enumerate(self.chunks)}
        self.local_output = {c: starts[chunk.unit_range[1]] for c, chunk in enumerate(self.chunks)
                             if chunk.unit_range[1] in starts}  # producer chunk -> consumer chunk
        self.local_input = {consumer: producer for producer, consumer in self.local_output.items()}
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype
        self.device = device
        # See hetpipe.models.precision: "bf16" and "fp8" run on ``weights`` (the working copies).
        if precision in WORKING_COPY_MODES and weights is None:
            raise ValueError(f"precision {precision!r} needs the chunks' Bf16Weights")
        self.precision = precision
        self.weights = weights
        self.recv_ahead = recv_ahead
        # A zero-bubble schedule splits backwards into B and W (see
        # hetpipe.models.split_backward); the first stage's B then ends at the
        # embedding's output, which the forward has to keep.
        self.split_backward = any(a.kind == BWD_INPUT for a in self.actions)
        # The last step's host time blocked on boundary receives and on the
        # step's sends (the straggler report counts the rest as busy). NCCL
        # boundary waits do not block the host, so on an NCCL-only pipeline
        # this stays near zero; tcp/direct waits block it.
        self.wait_s = 0.0

    def _compute(self, chunk: int):
        return compute_context(self.precision, self.device.type, self.weights, chunk)

    def warm_up(self, microbatch: tuple[torch.Tensor, torch.Tensor], forward_only: bool = False) -> None:
        """Run one forward and backward of every chunk with no communication,
        then drop the gradients, so that every compute kernel of a step is
        loaded before any boundary transfer is in flight; with
        ``forward_only`` (the run validates) also one forward without
        autograd, whose kernels can differ (the loss takes another path).

        CUDA loads kernels lazily (``CUDA_MODULE_LOADING=LAZY``, the default
        since CUDA 12.2), and loading one may synchronise the context. A
        receive posted ahead on an NCCL/RCCL boundary is a kernel that spins on
        the GPU until the peer sends; if this rank then runs a kernel for the
        first time, the load waits for the spinning receive while the peer
        waits for this rank: the first step deadlocks. This is the hang that
        same-vendor NCCL boundaries showed on 2xH200 (docs/benchmarks.md).
        The weights and optimizer are untouched; only ``.grad`` is reset.
        """
        tokens, labels = microbatch
        for c, chunk in enumerate(self.chunks):
            if chunk.is_first:
                x = tokens.to(self.device)
            else:
                x = torch.zeros(self.activation_shape, dtype=self.activation_dtype, device=self.device,
                                requires_grad=True)
            is_last = chunk.is_last
            with self._compute(c):
                out = chunk(x, labels.to(self.device) if is_last else None, tokens=tokens)
            if is_last:
                out.backward()
            else:
                out.backward(torch.zeros_like(out))
            for p in chunk.parameters():
                p.grad = None
            if forward_only:
                with torch.no_grad(), self._compute(c):
                    chunk(x.detach(), labels.to(self.device) if is_last else None, tokens=tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 loss_weights: Optional[Sequence[float] | torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward and backward every microbatch; gradients accumulate in the chunks.

        Each action goes to its handler in :attr:`_HANDLERS`, keyed by the
        action constants. The step's loss is the mean over microbatches of
        each microbatch's loss, each times its ``loss_weights`` entry where
        they are given (hetpipe.training.token_loss's make it the mean over tokens;
        without, it is the mean of the microbatch means). Returns the sum of
        the weighted microbatch losses (in microbatch order) on the rank that
        holds the last virtual stage, else None.
        """
        if loss_weights is not None:
            loss_weights = torch.as_tensor(loss_weights, dtype=torch.float32).to(self.device, non_blocking=True)
        step = _Step(microbatches, [a for a in self.actions if a.kind in (RECV_FWD, RECV_BWD)], loss_weights)
        for action in self.actions:
            handler = self._HANDLERS.get(action.kind)
            if handler is None:
                raise ValueError(f"unknown pipeline action {action}")
            handler(self, step, action)
        wait_start = time.perf_counter()
        for handle in step.sends:
            handle.wait()
        step.waited += time.perf_counter() - wait_start
        self.wait_s = step.waited
        loss_sum: Optional[torch.Tensor] = None
        if step.losses:
            for m in range(len(microbatches)):  # canonical order, whatever the schedule
                loss = _weighted(step.losses[m], step, m)
                loss_sum = loss if loss_sum is None else loss_sum + loss
        return loss_sum

    def _post_receives(self, step: _Step, limit: int) -> None:
        """Post the step's next receives, in list order (the channels' FIFO order), up to ``limit`` in all."""
        while step.next_recv < min(len(step.recvs), limit):
            a = step.recvs[step.next_recv]
            kind = _DIRECTION[a.kind]
            buf = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=self.device)
            handle = self.links[a.peer].irecv(buf, microbatch=a.microbatch, kind=kind)
            step.posted[(kind, a.microbatch, a.chunk)] = (buf, handle)
            step.next_recv += 1

    def _receive(self, step: _Step, action: Action) -> None:
        self._post_receives(step, step.done_recvs + self.recv_ahead)
        kind = _DIRECTION[action.kind]
        buf, handle = step.posted.pop((kind, action.microbatch, action.chunk))
        wait_start = time.perf_counter()
        handle.wait()
        step.waited += time.perf_counter() - wait_start
        step.received[(kind, action.microbatch, action.chunk)] = buf
        step.done_recvs += 1
        self._post_receives(step, step.done_recvs + self.recv_ahead)

    def _forward(self, step: _Step, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        chunk = self.chunks[action.chunk]
        tokens, labels = step.microbatches[action.microbatch]
        if chunk.is_first:
            x = tokens.to(self.device, non_blocking=True)
        else:
            x = step.received.pop((FWD,) + key).requires_grad_(True)
        is_last = chunk.is_last
        keep_embedding = self.split_backward and chunk.is_first
        with self._compute(action.chunk), \
                capture_output(chunk.embedding) if keep_embedding else nullcontext([]) as captured:
            out = step.out = chunk(x, labels.to(self.device, non_blocking=True) if is_last else None,
                                   tokens=tokens)
        if keep_embedding:
            step.embedded[key] = captured[0]
        step.inputs[key], step.outputs[key] = x, out
        if is_last:
            step.losses[action.microbatch] = out.detach()
        if action.chunk in self.local_output:  # what a send would carry, without a copy
            step.received[(FWD, action.microbatch, self.local_output[action.chunk])] = out.detach()

    def _send_forward(self, step: _Step, action: Action) -> None:
        out = step.outputs[(action.microbatch, action.chunk)]
        step.sends.append(self.links[action.peer].isend(out.detach(), microbatch=action.microbatch, kind=FWD))

    def _backward(self, step: _Step, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        out = step.out = step.outputs.pop(key)
        if self.chunks[action.chunk].is_last:
            _loss_root(out, step, action.microbatch).backward()
        else:
            out.backward(step.received.pop((BWD,) + key))
        self._backward_done(step, action)

    def _backward_input(self, step: _Step, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        chunk = self.chunks[action.chunk]
        out = step.out = step.outputs.pop(key)
        if chunk.is_last:
            out, grad = _loss_root(out, step, action.microbatch), None
            step.out = out
        else:
            grad = step.received.pop((BWD,) + key)
        chunk_input = step.embedded.pop(key) if chunk.is_first else step.inputs[key]
        grad_input, step.weight_backwards[key] = backward_input(out, grad, chunk_input)
        if not chunk.is_first:
            chunk_input.grad = grad_input  # what send_bwd sends, as after a whole backward
        self._backward_done(step, action)

    def _backward_done(self, step: _Step, action: Action) -> None:
        """After a backward or B: the first stage's input is no longer needed, and
        a hand-off to this rank's previous chunk gets the input's gradient in-process."""
        key = (action.microbatch, action.chunk)
        if self.chunks[action.chunk].is_first:
            step.inputs.pop(key, None)
        if action.chunk in self.local_input:
            step.received[(BWD, action.microbatch, self.local_input[action.chunk])] = step.inputs.pop(key).grad

    def _backward_weight(self, step: _Step, action: Action) -> None:
        step.weight_backwards.pop((action.microbatch, action.chunk)).run()

    def _send_backward(self, step: _Step, action: Action) -> None:
        x = step.inputs.pop((action.microbatch, action.chunk))
        step.sends.append(self.links[action.peer].isend(x.grad, microbatch=action.microbatch, kind=BWD))

    # The action set (hetpipe.pipeline.actions) -> what runs it; a test keeps it complete.
    _HANDLERS = {RECV_FWD: _receive, RECV_BWD: _receive, FWD: _forward, SEND_FWD: _send_forward,
                 BWD: _backward, BWD_INPUT: _backward_input, BWD_WEIGHT: _backward_weight,
                 SEND_BWD: _send_backward}

    def run_forward(self, actions: Sequence[Action],
                    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[list[torch.Tensor]]:
        """Run a forward-only action list (:func:`hetpipe.pipeline.schedules.forward_only`)
        without autograd: no graph is built, and a boundary activation is
        dropped once its send is posted (the send handle keeps it until the
        transfer is done). Receives are posted ahead by :meth:`_receive`, as in
        :meth:`run_step`.

        Returns each microbatch's loss, in microbatch order, on the rank that
        holds the last virtual stage, else None.
        """
        step = _Step(microbatches, [a for a in actions if a.kind == RECV_FWD])
        with torch.no_grad():
            for action in actions:
                handler = self._FORWARD_HANDLERS.get(action.kind)
                if handler is None:
                    raise ValueError(f"pipeline action {action} in a forward-only run")
                handler(self, step, action)
        for handle in step.sends:
            handle.wait()
        return [step.losses[m] for m in range(len(microbatches))] if step.losses else None

    def _forward_only(self, step: _Step, action: Action) -> None:
        """A forward without a graph: its output goes to the loss, to this rank's
        next chunk, or to the send that follows (which drops it)."""
        tokens, labels = step.microbatches[action.microbatch]
        chunk = self.chunks[action.chunk]
        x = tokens.to(self.device, non_blocking=True) if chunk.is_first else \
            step.received.pop((FWD, action.microbatch, action.chunk))
        with self._compute(action.chunk):
            out = chunk(x, labels.to(self.device, non_blocking=True) if chunk.is_last else None, tokens=tokens)
        if chunk.is_last:
            step.losses[action.microbatch] = out
        elif action.chunk in self.local_output:
            step.received[(FWD, action.microbatch, self.local_output[action.chunk])] = out
        else:
            step.outputs[(action.microbatch, action.chunk)] = out

    def _send_forward_only(self, step: _Step, action: Action) -> None:
        out = step.outputs.pop((action.microbatch, action.chunk))
        step.sends.append(self.links[action.peer].isend(out, microbatch=action.microbatch, kind=FWD))

    # What a forward-only list (validation) may hold -> what runs it.
    _FORWARD_HANDLERS = {RECV_FWD: _receive, FWD: _forward_only, SEND_FWD: _send_forward_only}
