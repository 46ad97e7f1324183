"""``python -m hetpipe.launch TORCHRUN_ARGS...``: see :mod:`hetpipe.launch.torchrun`."""
from hetpipe.launch.torchrun import main

main()
