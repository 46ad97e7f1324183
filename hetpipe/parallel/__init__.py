"""Intra-stage parallelism applied to a built model chunk as a separate step.

Each module here takes a :class:`hetpipe.models.CausalLM` chunk that was built
and initialised with full weights (``build_model``) and rewires it in place,
the way torchtitan's ``parallelize_*`` functions do, so the model code in
``hetpipe.models`` never has to know about process groups:

* :mod:`hetpipe.parallel.tensor` - Megatron-style tensor (and sequence)
  parallelism inside one pipeline stage.
"""
