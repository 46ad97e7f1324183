"""``python -m hetpipe.doctor cluster=NAME [+model=NAME] [overrides]``: see :mod:`hetpipe.doctor.cli`."""
from hetpipe.doctor.cli import main
from hetpipe.errors import run_hydra_cli

run_hydra_cli(main)
