"""``python -m hetpipe.doctor``: can a job start on these nodes? (the whole story in :mod:`~hetpipe.doctor.cli`).

* :mod:`~hetpipe.doctor.cli` - the entry point: finds the node's place, runs
  the parts in order, exchanges sheets and results through the rendezvous store;
* :mod:`~hetpipe.doctor.config` - its schema: pretrain's config plus the doctor's settings;
* :mod:`~hetpipe.doctor.facts` - this node's fact sheet;
* :mod:`~hetpipe.doctor.probe` - connect and bandwidth probes of the peers' NICs;
* :mod:`~hetpipe.doctor.report` - blockers, warnings and tables from sheets and probe results.

Nothing is imported here, so importing one part does not load hydra's entry point.
"""
