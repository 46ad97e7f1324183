"""What the command lines share: a sweep's jobs and summary (sweep_jobs, sweep_summary,
sweep_plot) and compare's verdicts (compare_verdict). The commands themselves are
hetpipe's top-level modules (pretrain, plan, compare, export) and its doctor and launch
packages. Nothing is imported here.
"""
