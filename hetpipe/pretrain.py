"""``python -m hetpipe.pretrain +model=NAME [overrides]``: the pretraining entry point.

Hydra composes ``configs/pretrain.yaml`` with the chosen model preset (or
none: ``checkpoint.load_hf=DIR`` alone takes the model from DIR's
config.json) and any overrides, checks them against the structured schemas in ``hetpipe.schema.pretrain_config``,
and hands the result to the trainer. ``--cfg job`` prints the composed config
without building anything; ``-m`` sweeps (hydra multirun: a failed job does not stop
the others, and the sweep ends with a table, hetpipe/cli/sweep_summary.py). Problems with the
input end in one ``hetpipe: error:`` line and exit status 2. The console - the
launcher's and every local rank's output, tracebacks included - is kept in the
run directory's ``pretrain.log`` (hetpipe.observe.console_log).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # before torch loads here: the ranks' server imports it meanwhile
    from hetpipe.launch.local import prestart, prints_only

    if not prints_only(sys.argv[1:]):
        from hetpipe.observe import console_log

        console_log.start()  # before the server starts: the ranks print through it (pretrain.log)
    prestart(sys.argv[1:])

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hetpipe.schema.pretrain_config import register_configs, resolve
from hetpipe.errors import run_cli, run_hydra_cli
from hetpipe.cli.sweep_jobs import run_sweep_job, sweep_exit_status

register_configs()


@hydra.main(version_base=None, config_path="pkg://hetpipe.configs", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    from hetpipe.observe import console_log

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    console_log.keep_in(run_dir / "pretrain.log")  # what the user sees, from here (and what was held)

    def _run() -> None:
        from hetpipe.process.torch_compat import require_supported_torch  # torch loads only for a real run
        from hetpipe.process.rank_env import under_torchrun

        if not under_torchrun():  # hetpipe.launch checked this node's torch already
            require_supported_torch()
        from hetpipe.launch.job_dirs import save_dir_locked
        from hetpipe.training.trainer import train

        job = resolve(cfg)
        with save_dir_locked(job.checkpoint, run_dir, job.cluster):  # the run dir's lock: configs/pretrain.yaml
            train(job, run_dir)

    if HydraConfig.get().mode == RunMode.MULTIRUN:  # a failed job is recorded, and the next one runs
        run_sweep_job(lambda: run_cli(_run), Path(HydraConfig.get().runtime.output_dir))
    else:
        run_cli(_run)


if __name__ == "__main__":
    run_hydra_cli(main)
    sys.exit(sweep_exit_status())
