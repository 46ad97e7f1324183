"""Intra-stage parallelism: tensor parallelism inside a pipeline stage, data
parallelism across its replicas, and checkpoints under both.

Model-independent pieces only; which module of a model is split how is the
model's plan (:mod:`hetpipe.models.parallelize`), as torchtitan keeps a
``parallelize`` per model, so the model code never sees a process group:

* :mod:`~hetpipe.parallel.tp_collectives` - Megatron's f/g (and sequence
  parallelism's) autograd collectives, and the vocab-parallel cross-entropy;
* :mod:`~hetpipe.parallel.tp_shards` - which slice of each parameter a TP
  rank holds (a mark on the parameter), column/row-parallel linears cut from
  a whole one, norm shares and the post-backward TP reductions;
* :mod:`~hetpipe.parallel.grad_reducer` - bucketed DP gradient averaging that
  overlaps backward;
* :mod:`~hetpipe.parallel.zero1` - AdamW with its state sharded over DP (ZeRO-1);
* :mod:`~hetpipe.parallel.context` - context parallelism: the load-balanced
  sequence shards and attention across them (all-gather of K/V, or a ring
  with log-sum-exp merging);
* :mod:`~hetpipe.parallel.group_facts` - group facts and torch-version
  shims both TP and DP use.
"""
