"""A failed job says what really failed: the rank that died first, and how.

Tried as a user would: one rank of a mixed tcp run is killed with SIGKILL (as
the OOM killer or ``kill -9`` would), or raises (a bug), through the
``HETPIPE_FAULT`` injection of hetpipe/process/faults.py. The other rank loses its
connection to it; that loss is a consequence and must never be reported as the
cause, nor end the job with status 2 (bad input). Each run is a tiny model
stopped at its third step, a few seconds after its ranks start.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cluster_nodes import JOB, start_nodes, wait_all
from conftest import run_cli
from emulated_nodes import emu, emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401

pytestmark = pytest.mark.timeout(240)

TINY = ["+model=tiny_llama", "cluster=cpu_mixed", "cluster.transport.kind=tcp", "data=demo",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.train_iters=4", "logging.progress=false"]


def pretrain(tmp_path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    return run_cli(["-m", "hetpipe.pretrain", *TINY, *overrides, f"hydra.run.dir={tmp_path}"], timeout=200,
                   env={"HETPIPE_FAULT": fault})


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hetpipe: error: ")]


def test_a_rank_killed_by_sigkill_is_named_first_with_its_signal(tmp_path):
    proc = pretrain(tmp_path, "kill@step:rank=1:step=3")
    out = proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1, (proc.returncode, out[-3000:])  # a crash: not 2, which is bad input
    assert re.fullmatch(r"hetpipe: error: rank 1 \(pid \d+\) was killed by SIGKILL", lines[0]), out[-3000:]
    # The survivor says the same cause, never the connection it lost.
    assert all("rank 1 (pid" in line and "SIGKILL" in line for line in lines), lines
    assert "lost" not in proc.stderr and "Traceback" not in proc.stderr, out[-3000:]


def test_an_exception_on_one_rank_is_the_cause_its_peers_report(tmp_path):
    proc = pretrain(tmp_path, "raise@step:rank=1:step=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (proc.returncode, out[-3000:])
    cause = "rank 1 failed: RuntimeError: injected fault at step of step 2 on rank 1 (traceback on its node)"
    # One line for the job, by whichever rank got there first; both ranks end with its status.
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and re.fullmatch(r"hetpipe: error: \[rank [01]\] " + re.escape(cause), lines[0]), out[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "lost" not in proc.stderr, out[-3000:]


def test_the_node_whose_rank_was_killed_reports_the_sigkill(tmp_path, emulated_nodes):
    # cpu_2node started per node by launch_cluster.sh (python -m hetpipe.launch):
    # node 1 runs ranks 2 and 3; rank 2 kills itself at step 3. The fault reaches
    # node 1's ranks through its interpreter, as test_node_faults.py's stuck node does.
    faulty = tmp_path / "python-with-fault"
    faulty.write_text(f'#!/bin/bash\nexport HETPIPE_FAULT="kill@step:rank=2:step=3"\nexec {sys.executable} "$@"\n')
    faulty.chmod(0o755)
    runs = start_nodes(emulated_nodes, [*JOB, "data=demo", "train.train_iters=6"], tmp_path,
                       python={1: str(faulty)})
    codes = wait_all(runs, timeout=180)
    outputs = [run.output() for run in runs]
    cause = re.compile(r"node 1 of 2: rank 2 \(pid \d+\) was killed by SIGKILL")
    node1 = runs[1].errors()
    assert codes == [1, 1], (codes, outputs[0][-2500:], outputs[1][-2500:])
    # Node 1's launcher says it first; its rank 3 may say the same, from the job's
    # store, unless the launcher's SIGTERM stopped it before (torch's agent stops
    # a node's other ranks as soon as it sees one die).
    assert node1[0].startswith("hetpipe: error: node 1 of 2: "), outputs[1][-3000:]
    assert all(cause.search(line) for line in node1), node1
    # Node 0's ranks read the same cause, not their lost connections to node 1.
    node0 = runs[0].errors()
    assert len(node0) == 1 and cause.search(node0[0]), outputs[0][-3000:]  # one line per node
    assert all("Traceback" not in out for out in outputs)


def test_oom_evidence_is_the_rise_of_the_cgroups_oom_kill_count(tmp_path):
    # The kernel's out-of-memory killer cannot be asked for here; its evidence can:
    # a v2 cgroup whose memory.events counts one more oom_kill after the rank
    # started than before, as /proc/<pid>/cgroup names it.
    from hetpipe.launch.exit_cause import Ending, OomCounters

    proc_dir, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc_dir / "4242").mkdir(parents=True)
    (proc_dir / "4242" / "cgroup").write_text("0::/job.slice/rank1\n")
    events = root / "job.slice" / "rank1" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
    counters = OomCounters(4242, proc=proc_dir, cgroup_root=root)
    killed = Ending(rank=1, pid=4242, signal=9)
    assert killed.describe(counters.evidence()) == "rank 1 (pid 4242) was killed by SIGKILL"
    events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 1\n")
    assert killed.describe(counters.evidence()) == (
        "rank 1 (pid 4242) was killed by SIGKILL, probably by the kernel's out-of-memory killer (the oom_kill "
        "count of memory cgroup /job.slice/rank1 (memory.events) rose from 0 to 1)")


def test_a_lost_connection_posted_first_yields_to_the_signal_death_behind_it():
    # When a peer's "connection lost" stands before the watch posted the SIGKILL
    # that caused it (a starved watch on a busy machine), the death is the cause.
    from hetpipe.errors import EXIT_CRASH, EXIT_LOST_PEER
    from hetpipe.launch.exit_cause import Ending
    from hetpipe.launch.agent import Cause, root_cause

    lost = Cause("connection to stage 1 (group amd, amd, rank 1) lost: the peer closed the connection",
                 EXIT_LOST_PEER, printed=True)
    killed = Ending(rank=1, pid=4242, signal=9)
    cause = root_cause(lost, killed)
    assert (cause.reason, cause.code, cause.printed) == ("rank 1 (pid 4242) was killed by SIGKILL", EXIT_CRASH, False)
    # Any other standing verdict stays: an exception a rank posted, or a lost
    # connection behind a rank the launcher itself stopped (SIGTERM).
    raised = Cause("rank 1 failed: RuntimeError: boom (traceback on its node)", EXIT_CRASH, printed=True)
    assert root_cause(raised, killed) is raised
    assert root_cause(lost, Ending(rank=1, pid=4242, signal=15)) is lost
    assert root_cause(lost, Ending(rank=1, pid=4242, status=3)) is lost
    assert root_cause(None, killed, node="node 1 of 2: ").reason == "node 1 of 2: rank 1 (pid 4242) was killed by SIGKILL"
