"""The directories a pretraining job makes its own before writing into them
(:mod:`hetpipe.launch.dir_lock`): its run directory and its checkpoint directory.

Hydra creates the run directory, writes ``.hydra/`` and opens ``pretrain.log``
in ``run_job``, before the task function runs, so the run directory is locked
by a hydra callback (:class:`JobDirsCallback`, named in configs/pretrain.yaml)
at ``on_run_start``, which hydra calls before ``run_job``: a second job on the
directory stops there, having written nothing. A multirun locks its sweep
directory at ``on_multirun_start`` (before ``multirun.yaml``) and each job's
own directory while the job runs. The checkpoint directory, which only the
trainer writes, is locked by the task function once the config is resolved
(:func:`save_dir_locked`), for this node where ``{node}`` is in it.

The process that locks is the one hydra runs in: the local launcher that
spawns a single node's ranks, or each rank under torchrun, where ranks of one
job share its id and join each other's lock.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hetpipe.errors import run_cli
from hetpipe.launch.dir_lock import acquire, release
from hetpipe.process.rank_env import under_torchrun

if TYPE_CHECKING:
    from hetpipe.checkpoint.settings import CheckpointConfig
    from hetpipe.devices.cluster import ClusterConfig


class JobDirsCallback(Callback):
    """Locks the run (or sweep, and each job's) directory before hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _lock(config, config.hydra.run.dir, "run directory", "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _lock(config, config.hydra.sweep.dir, "sweep directory", "hydra.sweep.dir")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # a run's directory is locked already
            _lock(config, config.hydra.runtime.output_dir, "run directory", "hydra.sweep.dir")

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # the next job of the sweep may share nothing with it
            release(Path(config.hydra.runtime.output_dir))


def _lock(config: DictConfig, directory: str, what: str, setting: str) -> None:
    """Lock ``directory`` or end this process with one line, exit 2."""
    break_lock = bool(OmegaConf.select(config, "checkpoint.break_lock", default=False))
    run_cli(lambda: acquire(Path(str(directory)), what, setting, break_lock))


@contextlib.contextmanager
def save_dir_locked(cfg: CheckpointConfig, run_dir: Path, cluster: ClusterConfig) -> Iterator[None]:
    """Hold ``checkpoint.save_dir`` (this node's) while the job runs. Without one,
    checkpoints go to ``<run_dir>/checkpoints``, under the run directory's lock."""
    from hetpipe.checkpoint.settings import resolve_save_dir  # the package loads torch: not before a run

    if cfg.save_dir is None:
        yield
        return
    directory = resolve_save_dir(cfg, run_dir, _node(cluster))
    taken = acquire(directory, "checkpoint directory", "checkpoint.save_dir", cfg.break_lock)
    try:
        yield
    finally:
        if taken:
            release(directory)


def _node(cluster: ClusterConfig) -> int:
    """This process's node index, as the checkpoint saver reads ``{node}``
    (a local launch is one node, node 0)."""
    if not under_torchrun():
        return 0
    from hetpipe.launch.nodes import NodeMap, launched_multi_node

    return NodeMap.layout(cluster, launched_multi_node(cluster)).node_of[int(os.environ["RANK"])]
