"""The pipeline: its vocabulary and its schedules (the engine that runs them is
:mod:`hetpipe.training.engine`).

A ground floor every other part of hetpipe may import (the partitioner
prices these schedules, the trainer runs them); it imports nothing of the
partitioner, the launcher, the doctor, checkpoints or the trainer.

* :mod:`~hetpipe.pipeline.actions` - what one rank can do: forward,
  backward (or B and W), send, receive;
* :mod:`~hetpipe.pipeline.microbatches` - how many microbatches a rank
  runs per step (the sampler and the planner count with it);
* :mod:`~hetpipe.pipeline.layouts` and :mod:`~hetpipe.pipeline.placement`
  - which virtual stage each (rank, chunk) holds: interleaved, or ZB-V's V;
* :mod:`~hetpipe.pipeline.registry` - one entry per schedule: its
  computations, placement, chunks, split backward and the facts the planner
  prices it by;
* :mod:`~hetpipe.pipeline.orders` and :mod:`~hetpipe.pipeline.schedule_zbv`
  - each schedule's order of computations;
* :mod:`~hetpipe.pipeline.schedules` - per-rank action lists (the orders
  with their sends and receives), and forward-only for validation;
* :mod:`~hetpipe.pipeline.schedule_check` - the simulator that proves a
  schedule and measures its peaks and makespan;
Nothing is imported here, so that a planner importing the vocabulary loads no
more of it than it reads.
"""
