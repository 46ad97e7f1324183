"""Global gradient-norm clipping that gives the same answer for every split.

``torch.nn.utils.clip_grad_norm_`` computes one norm per parameter and then
the norm of those norms, in parameter order. Across pipeline stages each rank
holds some of the parameters, so each computes its per-parameter norms, the
ranks exchange them over the world (gloo) group, and every rank stacks all of
them in the *whole model's* parameter order before taking the norm. The result
is bitwise the single-process value, whatever the split or schedule, and every
rank applies the same clip coefficient.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from hetpipe.models import CausalLM, ModelConfig
from hetpipe.parallel.tp_shards import tp_sq_norm_share
from hetpipe.process.torch_compat import foreach_mul_, foreach_norm


def global_parameter_order(cfg: ModelConfig) -> dict[str, int]:
    """Name -> position in the whole model's parameters() order (built on meta)."""
    with torch.device("meta"):
        whole = CausalLM(cfg)
    return {name: i for i, (name, _) in enumerate(whole.named_parameters())}


class ClipResult(NamedTuple):
    norm: torch.Tensor        # the global gradient norm (before clipping)
    extra: torch.Tensor       # the summed ``extra`` of every contributing rank
    side: torch.Tensor        # [world size, k]: every rank's ``side`` row (float32, CPU)


class GradNormClipper:
    """Clips gradients of this rank's chunks by the global norm over all ranks.

    Every parameter of the whole model has one position. A rank reports the
    norm of each parameter it *contributes*: with data parallelism only DP
    replica 0 reports (after the DP reduction all replicas hold the same
    gradients); with tensor parallelism every TP rank reports its shard's part
    (:func:`hetpipe.parallel.tp_shards.tp_sq_norm_share`; a tensor every TP rank
    holds whole is reported by TP rank 0 only). A position reported once takes
    that norm as it is - which keeps the no-TP, no-DP case bitwise equal to
    ``clip_grad_norm_`` in one process - and one reported by several TP ranks
    takes the square root of their summed squares.

    ``extra`` is an optional scalar (the step's loss sum on the last stage)
    piggy-backed on the same exchange, so logging costs no extra collective;
    pass ``extra_contributes=False`` on ranks whose value must not be counted
    (TP ranks other than 0 hold a copy of the same loss). ``side`` is a short
    per-rank vector (a preemption flag, the step's busy time) that comes back
    as every rank's row, on the same exchange.
    """

    def __init__(self, cfg: ModelConfig, chunks: Sequence[CausalLM], group: Optional[dist.ProcessGroup],
                 contributes: bool = True) -> None:
        order = global_parameter_order(cfg)
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        # A tied head copy on the last stage is not a separate model
        # parameter: its gradient equals the embedding's after the sync.
        mine = sorted((order[n], i, p) for i, (n, p) in enumerate(named) if n in order) if contributes else []
        self.positions = [pos for pos, _, _ in mine]
        self.params = [p for _, _, p in mine]
        self.all_params = [p for _, p in named]
        self.sharded = any(getattr(chunk, "tp_size", 1) > 1 for chunk in chunks)
        self.group = group
        self.total = len(order)
        self.world = dist.get_world_size(group) if group is not None else 1
        if self.world > 1:
            # Static layout: who reports which positions. One exchange at start.
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(counts, torch.tensor([len(self.positions)]), group=group)
            self.width = int(max(c.item() for c in counts))
            mine_pos = torch.full((self.width,), -1, dtype=torch.int64)
            mine_pos[: len(self.positions)] = torch.tensor(self.positions, dtype=torch.int64)
            gathered = [torch.empty_like(mine_pos) for _ in range(self.world)]
            dist.all_gather(gathered, mine_pos, group=group)
            self.layout = torch.cat(gathered)
            valid = self.layout >= 0
            self.reports = torch.bincount(self.layout[valid], minlength=self.total)

    def _norms(self) -> list[torch.Tensor]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if not grads:
            return []
        if not self.sharded:
            # fp32 norms also of bf16 gradients (train.precision=bf16-pure).
            return foreach_norm(grads, dtype=torch.float32)
        return [tp_sq_norm_share(p, g).sqrt() for p, g in zip(self.params, grads)]

    def clip(self, max_norm: float, extra: Optional[torch.Tensor] = None,
             extra_contributes: bool = True, side: Optional[torch.Tensor] = None) -> ClipResult:
        """Scale gradients in place by the global norm (unless it is not finite).

        With one rank the norm and ``extra`` stay on the device (no host sync
        in the step); across ranks the exchange goes through the CPU (gloo)
        anyway.
        """
        norms = self._norms()
        extra_value = extra.detach().float().reshape(1) if extra is not None and extra_contributes \
            else torch.zeros(1)
        side = torch.zeros(0) if side is None else side.detach().float().reshape(-1).cpu()
        k = side.numel()
        if self.world == 1:
            total = torch.linalg.vector_norm(torch.stack(norms))
            summed_extra = extra_value
            sides = side.reshape(1, k)
        else:
            local = torch.zeros(self.width + 1 + k, dtype=torch.float32)
            if norms:
                local[: len(norms)] = torch.stack(norms).float().cpu()
            local[self.width] = extra_value.cpu()[0]
            local[self.width + 1:] = side
            gathered = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(gathered, local, group=self.group)
            table = torch.stack(gathered)
            sides = table[:, self.width + 1:]
            summed_extra = table[:, self.width].sum().reshape(1)
            values = table[:, :self.width].reshape(-1)
            valid = self.layout >= 0
            ordered = torch.zeros(self.total, dtype=torch.float32)
            if int(self.reports.max()) <= 1:
                ordered[self.layout[valid]] = values[valid]
            else:
                # Several TP ranks reported parts of one tensor: sqrt of summed squares.
                squares = torch.zeros(self.total, dtype=torch.float32)
                squares.index_add_(0, self.layout[valid], values[valid].square())
                single = self.reports == 1
                ordered[self.layout[valid]] = values[valid]
                ordered = torch.where(single, ordered, squares.sqrt())
            device = norms[0].device if norms else (self.all_params[0].device if self.all_params
                                                    else torch.device("cpu"))
            total = torch.linalg.vector_norm(ordered.to(device))
        if max_norm > 0 and self.all_params:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grads_all = [p.grad for p in self.all_params if p.grad is not None]
            if grads_all:
                foreach_mul_(grads_all, coef.to(grads_all[0].device))
        return ClipResult(total.detach(), summed_extra[0], sides)


def sync_tied_embedding_grads(chunks: Sequence[CausalLM], group: Optional[dist.ProcessGroup]) -> None:
    """Sum the gradients of the embedding and its tied head copy on the first
    and last stage (Megatron's embedding group). Without a group: a no-op when
    one chunk holds both (they are one weight), and a local sum when two
    chunks of this rank do (zb_v's V puts the first and last stage on rank 0)."""
    if group is None:
        tied = [chunk.embedding.weight for chunk in chunks if chunk.embedding is not None and chunk.head is None]
        tied += [chunk.head.output.weight for chunk in chunks if chunk.head is not None
                 and chunk.head.output is not None and chunk.embedding is None]
        if len(tied) == 2 and chunks[0].cfg.share_embeddings_and_output_weights and \
                all(w.grad is not None for w in tied):
            total = tied[0].grad + tied[1].grad  # what the two-rank all-reduce adds
            for weight in tied:
                weight.grad.copy_(total)
        return
    for chunk in chunks:
        weight = None
        if chunk.embedding is not None and chunk.head is None:
            weight = chunk.embedding.weight
        elif chunk.head is not None and chunk.head.output is not None and chunk.embedding is None:
            weight = chunk.head.output.weight
        if weight is not None and weight.grad is not None:
            grad = weight.grad.cpu() if weight.grad.is_cuda else weight.grad
            dist.all_reduce(grad, group=group)
            if grad is not weight.grad:
                weight.grad.copy_(grad)
