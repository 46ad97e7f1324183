"""How many microbatches one pipeline rank runs per optimizer step: the
global batch shared out over the DP replicas, in microbatches (Megatron's
num_microbatches for a constant global batch). The data sampler, the
planner's search and the plan (``Plan.microbatches``, which the engine, the
reducer, the validator and the memory model ask) count with this function."""


def microbatches_per_step(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Microbatches per step and DP replica (the config checks divide evenly)."""
    return global_batch_size // (micro_batch_size * dp_size)
