"""Starting a job's ranks and ending them with one cause: everything between a
command line and a rank's first training step, and after its last.

* :mod:`~hetpipe.launch.local` - ``launch()``: run a function on every rank,
  under torchrun or by spawning this machine's ranks (the local launcher);
* :mod:`~hetpipe.launch.torchrun` - ``python -m hetpipe.launch``: torchrun
  with one-line failures, one per node of a multi-node job;
* :mod:`~hetpipe.launch.agent` - torch's elastic agent plus the root cause of
  a failure, a line per restart and each attempt's environment;
* :mod:`~hetpipe.launch.hung_ranks` - a failing attempt's stopped or deaf ranks
  SIGKILLed instead of waited for;
* :mod:`~hetpipe.launch.store_bind` - the launcher's stores listen where the job
  dials them, not on every interface;
* :mod:`~hetpipe.launch.fd_limit` - the open-file limit each launcher and rank
  needs: raised, or one line;
* :mod:`~hetpipe.launch.exit_cause` - how a rank's process ended (signal, OOM killer);
* :mod:`~hetpipe.launch.job_watch` - every rank stops with the one cause
  posted in the job's store;
* :mod:`~hetpipe.launch.verdicts` and :mod:`~hetpipe.launch.store_seal` - that
  cause in the store, sealed with the job secret (forgeries are ignored);
* :mod:`~hetpipe.launch.store_calls` - store requests that end in time when
  the way to the store is gone;
* :mod:`~hetpipe.launch.nodes` - which node each rank runs on, and the roll call;
* :mod:`~hetpipe.launch.scheduler_env` - a node's place from plain variables,
  Slurm or Kubernetes (``python -m hetpipe.launch.scheduler_env``, what
  scripts/launch_cluster.sh evals);
* :mod:`~hetpipe.launch.job_secret` - the secret that authenticates the
  job's connections;
* :mod:`~hetpipe.launch.restart` - what a restarted job resumes from;
* :mod:`~hetpipe.launch.dir_lock` and :mod:`~hetpipe.launch.job_dirs` - one live
  job per run and checkpoint directory, locked before anything is written there;
* :mod:`~hetpipe.launch.preemption` - saving on a scheduler's stop signal.

This process's rank and restart attempt, and the faults tests inject, are
:mod:`hetpipe.process.rank_env` and :mod:`hetpipe.process.faults`, below both this
package and the checkpoint saver that reads them.

Nothing is imported here: a CLI imports :mod:`~hetpipe.launch.local` before
torch (to start the fork server early).
"""
