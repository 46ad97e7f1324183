"""``python -m hetpipe.scheduler_env``: the command's name before the launch package
(now ``python -m hetpipe.launch.scheduler_env``), kept so that node scripts written
for it still run."""
from hetpipe.launch.scheduler_env import main

if __name__ == "__main__":
    main()
