"""The peer benchmark's stage modules and gradient handling (scripts/bench_pipelining_peer.py).

What each pipeline stage of the torch.distributed.pipelining peer is: a slice
of our CausalLM with bf16 autocast around its forward (:class:`PeerStage`),
the loss function the schedule calls on the last stage, the local warm-up
that loads kernels and yields the stage's tensor metadata, and what the step
does with gradients afterwards: a tied embedding's two copies summed, the
global norm clipped over both ranks. Kept apart from the driver (options,
spawning, one rank's loop, the summary) so each file does one job.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetpipe.models.layers import rope_cos_sin
from hetpipe.process.torch_compat import foreach_mul_, foreach_norm


# --------------------------------------------------------------------------- the stage

def _body(chunk, x: torch.Tensor) -> torch.Tensor:
    """The chunk's embedding and decoder layers (CausalLM.forward without the head)."""
    x = chunk.embedding(x) if chunk.embedding is not None else x
    if chunk.layers:
        cos, sin = rope_cos_sin(chunk.inv_freq, x.shape[1], x.dtype)
        for layer in chunk.layers.values():
            x = layer(x, cos, sin)
    return x


class PeerStage(nn.Module):
    """One stage for PipelineStage: our CausalLM slice, autocast around its forward.

    The last stage returns the logits, or (``head_in_loss``) the hidden states
    before the head, which ``loss_fn`` then turns into the loss.
    """

    def __init__(self, chunk, amp_device: Optional[str], head_in_loss: bool) -> None:
        super().__init__()
        self.chunk = chunk
        self.amp_device = amp_device
        self.head_in_loss = head_in_loss

    # Test hook (BENCH_PEER_FAKE_OOM="rank,step"): raise an out-of-memory error
    # in this stage's forward at that step, to exercise the OOM report on a CPU.
    fake_oom_step: Optional[int] = None
    step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fake_oom_step is not None and self.step == self.fake_oom_step:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (BENCH_PEER_FAKE_OOM)")
        with torch.autocast(self.amp_device or "cpu", dtype=torch.bfloat16, enabled=self.amp_device is not None):
            if self.chunk.is_last and self.head_in_loss:
                return _body(self.chunk, x)
            return self.chunk(x)  # hidden states, or the logits on the last stage


def make_loss_fn(stage: PeerStage, fused_ce: bool):
    head = stage.chunk.head
    amp = stage.amp_device

    def logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def head_loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(amp or "cpu", dtype=torch.bfloat16, enabled=amp is not None):
            if fused_ce:
                return head(hidden, target)
            return F.cross_entropy(head.logits(hidden).float().flatten(0, 1), target.flatten())

    if head is None:
        return logits_loss  # never called off the last stage; it only marks the schedule as training
    return head_loss if stage.head_in_loss else logits_loss


def _meta_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(requires_grad)


def warm_up(module: PeerStage, loss_fn, first: bool, opts: argparse.Namespace, cfg, device: torch.device,
            act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One local forward + backward of this stage (no communication), then the
    gradients are dropped. It loads every CUDA kernel (and compiles the layers)
    before the first receive is posted: a lazy kernel load while an NCCL
    receive spins can deadlock the first step (see PipelineEngine.warm_up).
    It also yields the stage's input/output tensor metadata for PipelineStage."""
    shape = (opts.micro_batch_size, opts.seq_length)
    if first:
        x = torch.zeros(shape, dtype=torch.long, device=device)
    else:
        x = torch.zeros(*shape, cfg.hidden_size, dtype=act_dtype, device=device, requires_grad=True)
    out = module(x)
    if module.chunk.is_last:
        loss_fn(out, torch.zeros(shape, dtype=torch.long, device=device)).backward()
    else:
        out.backward(torch.zeros_like(out))
    for p in module.parameters():
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _meta_like(x, not first), _meta_like(out, not module.chunk.is_last)


# --------------------------------------------------------------------------- gradients

def _tied_copies(chunks) -> list[torch.Tensor]:
    """This rank's copies of a tied embedding/head weight, each held by a chunk
    without the other (two in a V, where rank 0 holds both ends)."""
    if not chunks[0].cfg.share_embeddings_and_output_weights:
        return []
    return ([c.embedding.weight for c in chunks if c.embedding is not None and c.head is None]
            + [c.head.output.weight for c in chunks if c.head is not None and c.embedding is None])


def sync_tied(chunks) -> None:
    """Sum a tied weight's two gradients: locally when both copies are here,
    else over the two ranks (both then hold one)."""
    copies = [w for w in _tied_copies(chunks) if w.grad is not None]
    if len(copies) == 2:
        total = copies[0].grad + copies[1].grad
        for w in copies:
            w.grad.copy_(total)
    elif len(copies) == 1:
        dist.all_reduce(copies[0].grad)


def clip_global_norm(chunks, max_norm: float, device: torch.device) -> torch.Tensor:
    """Global gradient norm over both ranks (a tied head copy counted once);
    scales the gradients when ``max_norm`` > 0. Returns the norm (on ``device``)."""
    heads = {id(c.head.output.weight) for c in chunks if c.head is not None}
    skip = {id(w) for w in _tied_copies(chunks) if id(w) in heads}  # the embedding's copy is counted
    params = [p for c in chunks for p in c.parameters()]
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    if grads:
        norms = foreach_norm(grads)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum().reshape(1)
    else:
        sq = torch.zeros(1, device=device)
    dist.all_reduce(sq)
    total = sq.sqrt()[0]
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        all_grads = [p.grad for p in params if p.grad is not None]
        if all_grads:
            foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
    return total
