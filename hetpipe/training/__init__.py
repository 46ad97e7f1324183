"""One rank's training: the loop (trainer), its process groups and channels (topology),
the engine that runs a schedule's action list, validation (evaluate) and the step's
helpers (gradients, nonfinite, token_loss, determinism, schedule_change, memory_fit,
host_memory_fit). Nothing is imported here.
"""
