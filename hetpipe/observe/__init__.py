"""What a run reports about itself: metrics (metrics.jsonl, console, wandb, TensorBoard),
the sample log, the straggler report, profiling, the memory peak and the console log.
Nothing is imported here.
"""
