"""Hydra config groups (model/, train/, data/, ...); loaded as pkg://hetpipe.configs."""
