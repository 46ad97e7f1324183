"""train.deterministic (hetpipe/determinism.py) and what it rests on: the
local launcher's environment for every rank.

CPU kernels are deterministic already, so on CPU the mode changes no number;
what these tests can show is the mode's plumbing (flags, the ranks'
environment, one-line refusals). That GPU runs repeat bit for bit is for GPUs.
"""
from conftest import run_cli


def test_the_local_launcher_puts_env_in_every_rank_before_it_runs():
    # A forked rank gets the fork server's environment, not the launcher's:
    # only launch's env can reach it. os.getenv runs on each rank; rank 0's answer comes back.
    code = ("import os\n"
            "from hetpipe.cluster import ClusterConfig, GroupConfig\n"
            "from hetpipe.launch.local import launch\n"
            "groups = [GroupConfig(name=n, vendor=n, device_type='CPU', ranks_per_node=1) for n in ('nvidia', 'amd')]\n"
            "cluster = ClusterConfig(name='probe', emulate=True, groups=groups)\n"
            "print(launch(cluster, os.getenv, 'HETPIPE_PROBE', env={'HETPIPE_PROBE': 'from the launcher'}))\n"
            "print(os.getenv('HETPIPE_PROBE'))\n")
    proc = run_cli(["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["from the launcher", "None"]
