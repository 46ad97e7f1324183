"""A chunk's backward split in two: B, the gradient with respect to the
chunk's input, and W, the weight gradients, run later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024) rest on one observation: the previous stage waits only for the input
gradient, while the weight gradients (half of the backward's FLOPs) are
needed only by the optimizer step, so they can be postponed to fill the
pipeline's bubbles. :func:`backward_input` runs B and returns a
:class:`WeightBackward` whose :meth:`~WeightBackward.run` is W.

How the work is divided, with no operation done twice:

* The decoder's linears under gradient-accumulation fusion
  (:class:`hetpipe.models.precision._LinearMainGrad`) compute their weight
  gradient as one GEMM of their own into fp32 ``.grad``. During B they
  queue that GEMM, with the saved input and the output gradient, instead of
  running it (:func:`hetpipe.models.precision.deferring_main_grads`); W runs the
  queue. This is the GEMM-heavy part on GPUs.
* Every other weight gradient (plain linears in fp32, norms, embedding,
  head, biases) is split on the autograd graph. A *B node* is one from which
  the chunk's input can be reached; every other node only leads to
  parameters. Backward of the chunk's input runs only B nodes, and a B node
  computes only the gradients that lead to B nodes (autograd skips the
  others). At a B node with an edge into the parameters-only part, B keeps
  what W needs: for built-in nodes the node's incoming gradient (W reruns
  that node for its parameter edges alone, e.g. ``mm`` computing only
  ``grad^T @ x``); for custom autograd Functions, which return every
  gradient anyway (the fused loss computed them in its forward), the
  gradient it produced on that edge. W then backpropagates those gradients
  through the parameters-only part, so autograd itself accumulates into
  ``.grad`` and runs the parameters' post-accumulate hooks (the DP reducer
  counts them), after W and never after B.

Each weight gradient is therefore the same tensor 1F1B computes, added to
``.grad`` the same way; with Ws in microbatch order the sums are bitwise
those of 1F1B (tests/test_zero_bubble.py).

Cost: B keeps the graph (``retain_graph``), so a unit between B and W holds
its activations, not only W's inputs (what the schedule simulator reports
as ``max_in_flight``); W reruns one node per weight, about half of the
backward's FLOPs, plus a Python walk of the graph per microbatch.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from hetpipe.models.precision import deferring_main_grads
from hetpipe.process.torch_compat import disable_donated_buffers


class WeightBackward:
    """What B left for W: the nodes to rerun for their parameter edges, the
    gradients entering the parameters-only part, and the queued GEMMs."""

    def __init__(self) -> None:
        # (node, its incoming gradients, its edges into the parameters-only part)
        self.reruns: list[tuple[Node, tuple, list[GradientEdge]]] = []
        self.edges: list[tuple[GradientEdge, torch.Tensor]] = []
        self.main_grads: list[Callable[[], None]] = []

    def run(self) -> None:
        """W: every weight gradient of the microbatch, accumulated into ``.grad``."""
        for node, grads, targets in self.reruns:
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not roots:
                continue
            produced = torch.autograd.grad([e for e, _ in roots], targets, grad_outputs=[g for _, g in roots],
                                           allow_unused=True)
            self.edges += [(e, g) for e, g in zip(targets, produced) if g is not None]
        # Inside autograd's backward, where 1F1B runs these GEMMs, grad mode is
        # off; here it is on, and the GEMM would record a graph: main.grad then
        # held the microbatch's saved input, and through it the whole retained
        # graph. Measured on one H100 (LLaMA-3-8B shapes, 2 layers, seq 4096, 8
        # microbatches): +11.1 GiB of allocated memory per step until out of
        # memory; with no_grad, flat at 1f1b's (docs/benchmarks.md).
        with torch.no_grad():
            for gemm in self.main_grads:
                gemm()
        if self.edges:
            torch.autograd.backward([e for e, _ in self.edges], grad_tensors=[g for _, g in self.edges])
        self.reruns, self.edges, self.main_grads = [], [], []


def allow_retained_graphs() -> None:
    """Let compiled backwards run with a retained graph, as B needs (it keeps
    the stage's graph for W). AOT autograd's compiled backwards - the fused
    elementwise kernels GPU ranks use by default - donate their saved buffers
    and then refuse ``retain_graph``; this turns donation off and must run
    before anything compiles. Measured with ``scripts/bench_layer.py
    --variants fused,fused+split`` on one H100 (LLaMA-3-8B layers, seq 8192):
    B+W 14.53 ms against 14.63 ms for the fused backward, peak memory 15.5
    against 13.1 GiB for 4 layers x 4 microbatches (docs/benchmarks.md)."""
    disable_donated_buffers()


def backward_input(output: torch.Tensor, grad_output: Optional[torch.Tensor],
                   chunk_input: torch.Tensor) -> tuple[torch.Tensor, WeightBackward]:
    """B: the gradient of ``output`` (a loss when ``grad_output`` is None) with
    respect to ``chunk_input``, and the :class:`WeightBackward` that completes
    the backward.

    ``chunk_input`` is the tensor received from the previous stage, or, on the
    first stage, the embedding's output (:func:`capture_output`): the
    embedding's gradient is then W's like any other weight's.
    """
    in_edge = get_gradient_edge(chunk_input)
    in_node = in_edge.node
    reaches_input = _nodes_reaching(output.grad_fn, in_node)
    pending = WeightBackward()
    handles = []
    for node in reaches_input:
        if node is in_node:
            continue
        weight_edges = [i for i, (child, _) in enumerate(node.next_functions)
                        if child is not None and child not in reaches_input]
        if not weight_edges:
            continue
        if isinstance(node, BackwardCFunction):
            handles.append(node.register_hook(_keep_produced(pending, node, weight_edges)))
        else:
            targets = [GradientEdge(*node.next_functions[i]) for i in weight_edges]
            handles.append(node.register_prehook(_keep_incoming(pending, node, targets)))
    try:
        with deferring_main_grads(pending.main_grads):
            (grad_input,) = torch.autograd.grad(output, chunk_input, grad_outputs=grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    if any(child is not None for child, _ in in_node.next_functions):
        pending.edges.append((in_edge, grad_input))  # the first stage's embedding
    return grad_input, pending


def _keep_incoming(pending: WeightBackward, node: Node, targets: list[GradientEdge]):
    def hook(grad_outputs: tuple) -> None:
        pending.reruns.append((node, grad_outputs, targets))
    return hook


def _keep_produced(pending: WeightBackward, node: Node, weight_edges: list[int]):
    def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
        for i in weight_edges:
            if grad_inputs[i] is not None:
                pending.edges.append((GradientEdge(*node.next_functions[i]), grad_inputs[i]))
    return hook


def _nodes_reaching(root: Node, target: Node) -> set[Node]:
    """The nodes of ``root``'s graph from which ``target`` can be reached
    (``target`` included), found without recursion: graphs are deep."""
    reaching: set[Node] = set()
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            done.add(node)
            if node is target or any(c in reaching for c, _ in node.next_functions if c is not None):
                reaching.add(node)
            continue
        if node in done:
            continue
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in done)
    return reaching


@contextlib.contextmanager
def capture_output(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The outputs of ``module``'s forwards inside the block, in a list."""
    outputs: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()
