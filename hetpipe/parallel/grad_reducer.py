"""Data-parallel gradient reduction: bucketed gradient averaging that overlaps
the backward pass.

Every data-parallel (DP) replica of a pipeline stage holds the same parameters
and runs its own share of the step's microbatches. :class:`GradReducer` makes
their gradients the average over the DP group, following PyTorch DDP (Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020) and Megatron-LM's contiguous gradient buffer. The
parameters are packed, in *reverse* registration order (roughly the order
backward produces their gradients), into buckets of about ``bucket_bytes``;
every parameter's ``.grad`` is a view into its bucket's slice of one flat
buffer, so no copy is needed before a collective. A post-accumulate-grad hook
counts how many times each parameter's gradient was accumulated in this step.
A parameter is *ready* when that count reaches ``microbatches_per_step`` -
only the last microbatch's backward makes anything ready, so accumulating over
microbatches costs no extra communication - and a bucket whose parameters are
all ready is pre-divided by the DP size and all-reduced asynchronously while
backward goes on. Buckets are launched strictly in bucket order (as DDP does),
so every rank issues the same collectives in the same order even when
gradients become ready in a different order on different ranks.
:meth:`GradReducer.finish` launches whatever never became ready (a parameter
without gradient counts as zeros, again so all ranks issue identical
collectives) and waits.

A training step (with the ZeRO-1 optimizer of :mod:`hetpipe.parallel.zero1`
or a plain ``torch.optim.AdamW``, which then keeps full state on each
replica; the order matters)::

    reducer = GradReducer(chunks, dp_group, microbatches_per_step=local_micro)
    for step in ...:
        engine.run_step(my_microbatches)   # hooks launch bucket all-reduces
        reducer.finish()                   # grads are now the DP average
        sync_tied_embedding_grads(...)     # anything else that reads grads: after finish()
        clip(...)                          # after finish(): sees averaged grads
        optimizer.step()
        reducer.zero_grad()                # one fill per buffer; keeps the .grad views
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.parallel.group_facts import group_size_rank


@dataclass
class _Bucket:
    index: int
    params: list[int] = field(default_factory=list)      # parameter indices
    numel: int = 0
    buffer: Optional[torch.Tensor] = None                # slice of the flat grad buffer
    pending: int = 0                                     # params not yet ready this step
    work: Any = None


class GradReducer:
    """Averages (or sums) gradients over ``group``, bucketed and overlapped with backward.

    Parameters
    ----------
    modules:
        The modules whose parameters are reduced (e.g. this rank's pipeline
        chunks). Parameters are taken in ``modules`` order, then
        ``parameters()`` order, without duplicates; those with
        ``requires_grad=False`` are left alone.
    group:
        The data-parallel process group (``None``: the default group). gloo
        and NCCL both work. With one rank no collective is issued.
    bucket_bytes:
        Target bucket size. A parameter is never split across buckets, so a
        bucket holding one large parameter may be bigger.
    microbatches_per_step:
        How many backward passes reach each parameter per optimizer step (the
        number of microbatches *this rank* runs). A parameter's gradient is
        all-reduced once, after its last accumulation.
    reduce_op:
        ``"avg"`` (sum divided by the group size; the division is done
        before the all-reduce, as Megatron does, which needs no AVG support
        from the backend and keeps bf16 sums in range) or ``"sum"``.

    Gradient storage: each parameter's ``.grad`` is a view into a persistent
    flat buffer (Megatron's contiguous gradient buffer, DDP's
    ``gradient_as_bucket_view``). Autograd accumulates into an existing
    ``.grad`` in place, so the view survives backward. Preferred zeroing is
    :meth:`zero_grad` (one fill per buffer) or
    ``optimizer.zero_grad(set_to_none=False)``. ``set_to_none=True`` is also
    correct, only slower: the first accumulation after it lands in a fresh
    tensor, which the hook copies into the buffer and replaces by the view
    again. A parameter with no gradient at :meth:`finish` gets a zero view,
    so after ``finish()`` every parameter has a (DP-averaged) ``.grad``.

    Each step: run all microbatches' forward/backward, then :meth:`finish`.
    Do not read or modify gradients between a bucket's launch and
    :meth:`finish`, and do not run more backward passes than
    ``microbatches_per_step`` per step (that raises in the hook).
    """

    def __init__(self, modules: Sequence[nn.Module], group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = 25 * 2**20, *, microbatches_per_step: int,
                 reduce_op: str = "avg") -> None:
        if microbatches_per_step < 1:
            raise ValueError(f"microbatches_per_step={microbatches_per_step} must be at least 1")
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"reduce_op={reduce_op!r} must be 'avg' or 'sum'")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.microbatches_per_step = microbatches_per_step
        self.reduce_op = reduce_op
        self.bucket_bytes = bucket_bytes

        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)

        # Buckets in reverse parameter order, one open bucket per (device, dtype).
        self.buckets: list[_Bucket] = []
        self._bucket_of: list[int] = [0] * len(self.params)
        open_bucket: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            key = (p.device, p.dtype)
            b = open_bucket.get(key)
            if b is not None and b.numel and (b.numel + p.numel()) * p.element_size() > bucket_bytes:
                b = None
            if b is None:
                b = _Bucket(index=len(self.buckets))
                self.buckets.append(b)
                open_bucket[key] = b
            b.params.append(i)
            b.numel += p.numel()
            self._bucket_of[i] = b.index

        # One flat buffer per (device, dtype); buckets are consecutive slices of it.
        self._buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        by_key: dict[tuple[torch.device, torch.dtype], list[_Bucket]] = {}
        for b in self.buckets:
            p0 = self.params[b.params[0]]
            by_key.setdefault((p0.device, p0.dtype), []).append(b)
        for (device, dtype), buckets in by_key.items():
            flat = torch.zeros(sum(b.numel for b in buckets), dtype=dtype, device=device)
            self._buffers.append(flat)
            offset = 0
            for b in buckets:
                b.buffer = flat[offset:offset + b.numel]
                inner = 0
                for i in b.params:
                    p = self.params[i]
                    self._views[i] = b.buffer[inner:inner + p.numel()].view_as(p)
                    inner += p.numel()
                offset += b.numel

        with torch.no_grad():
            for i, p in enumerate(self.params):
                self._adopt(i)
        self._counts = [0] * len(self.params)
        self._next_bucket = 0
        self._launched: list[int] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self.params)]
        self._reset_pending()
        #: Events of the current step, in order: ("grad", param index) when a
        #: parameter's gradient was accumulated, ("launch", bucket index)
        #: when a bucket's all-reduce was started, ("finish", -1).
        self.events: list[tuple[str, int]] = []
        #: The events of the last finished step (for tests and profiling).
        self.last_step_events: list[tuple[str, int]] = []
        #: How many collectives the last finished step issued.
        self.num_collectives_last_step = 0

    # -- introspection -----------------------------------------------------

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def bucket_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in bucket (launch) order."""
        return [[self.params[i] for i in b.params] for b in self.buckets]

    # -- the step ----------------------------------------------------------

    def _adopt(self, i: int) -> None:
        """Make ``params[i].grad`` the bucket view, keeping its current value (None -> 0)."""
        p, view = self.params[i], self._views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            view.copy_(grad)
        else:
            return
        p.grad = view

    def _reset_pending(self) -> None:
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad(i)
        return hook

    def _on_grad(self, i: int) -> None:
        count = self._counts[i] + 1
        if count > self.microbatches_per_step:
            raise RuntimeError(
                f"GradReducer: parameter {i} received gradient {count} times in one step, more than "
                f"microbatches_per_step={self.microbatches_per_step}; its bucket is already being reduced. "
                "Call finish() after each step's backward passes, and pass the number of microbatches "
                "this rank runs per step.")
        self._counts[i] = count
        self.events.append(("grad", i))
        with torch.no_grad():
            self._adopt(i)
        if count == self.microbatches_per_step:
            b = self.buckets[self._bucket_of[i]]
            b.pending -= 1
            # Launch in bucket order only, so every rank issues the same sequence.
            while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
                self._launch(self.buckets[self._next_bucket])
                self._next_bucket += 1

    def _launch(self, b: _Bucket) -> None:
        if self.world_size == 1:
            return
        with torch.no_grad():
            if self.reduce_op == "avg":
                b.buffer.div_(self.world_size)
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        self._launched.append(b.index)
        self.events.append(("launch", b.index))

    def finish(self) -> None:
        """Complete this step's reduction: launch the buckets that never became
        ready (missing gradients count as zeros), wait for every collective and
        reset the per-step counters. Afterwards every parameter's ``.grad`` is
        its bucket view holding the DP average (or sum)."""
        with torch.no_grad():
            while self._next_bucket < len(self.buckets):
                b = self.buckets[self._next_bucket]
                for i in b.params:
                    self._adopt(i)
                self._launch(b)
                self._next_bucket += 1
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
            for i in range(len(self.params)):  # a caller may have replaced a ready .grad
                if self.params[i].grad is None:
                    self.params[i].grad = self._views[i]
        self.events.append(("finish", -1))
        self.num_collectives_last_step = len(self._launched)
        self.last_step_events = self.events
        self._start_step()

    def reset(self) -> None:
        """Abandon the current step: wait for anything in flight and clear the
        counters (gradients are left as they are). Only safe when every rank
        of the group abandons the same step."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
        self._start_step()

    def _start_step(self) -> None:
        """Clear the per-step counters, events and launched collectives."""
        self.events = []
        self._launched = []
        self._counts = [0] * len(self.params)
        self._next_bucket = 0
        self._reset_pending()

    def zero_grad(self) -> None:
        """Zero all gradients with one fill per buffer and point every ``.grad``
        back at its view (undoing any ``zero_grad(set_to_none=True)``)."""
        with torch.no_grad():
            for flat in self._buffers:
                flat.zero_()
            for p, view in zip(self.params, self._views):
                p.grad = view

    def remove(self) -> None:
        """Unregister the hooks (gradients stay where they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
