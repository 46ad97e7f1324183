"""The suite's way of running ``python -m`` commands (tests/cli_zygote.py): what a
command sees and how it ends must be what a fresh interpreter gives."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import cli_zygote
from conftest import USUAL_ENV

pytestmark = pytest.mark.skipif(os.environ.get("HETPIPE_TEST_FRESH_PYTHON") == "1",
                                reason="HETPIPE_TEST_FRESH_PYTHON=1: every command runs fresh")

PROBE = """
import atexit, json, os, signal, sys, threading, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "main": __name__,
                  "probe": os.environ.get("HETPIPE_PROBE")}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
atexit.register(lambda: print("atexit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("a non-daemon thread finished"))).start()
print("no newline", end="")
how = sys.argv[1]
if how == "message":
    sys.exit("the probe's exit message")
if how == "raise":
    raise ValueError("the probe's own error")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "hang":
    import time
    time.sleep(60)
sys.exit(int(how))
"""


@pytest.fixture()
def probe(tmp_path):
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    return tmp_path


def _run(probe, *args, env=None, timeout=30):
    env = {**USUAL_ENV, **(env or {})}
    done = cli_zygote.run_module("zygote_probe", list(args), env, str(probe), timeout, USUAL_ENV)
    fresh = subprocess.run([sys.executable, "-m", "zygote_probe", *args], cwd=probe, env=env, text=True,
                           capture_output=True, timeout=timeout)
    return done, fresh


def test_a_forked_command_sees_and_ends_as_a_fresh_one(probe):
    import json

    for how in ("0", "3", "raise", "message", "kill"):
        done, fresh = _run(probe, how, "x=1", env={"HETPIPE_PROBE": "seen"})
        assert done is not None, "the zygote was not used"
        assert done.returncode == fresh.returncode, how
        assert json.loads(done.stdout.splitlines()[0]) | {"pid": 0} == \
            json.loads(fresh.stdout.splitlines()[0]) | {"pid": 0}
        assert json.loads(done.stdout.splitlines()[0])["pid"] != os.getpid()
        # The thread joined, then the atexit handler: as a fresh interpreter ends.
        assert done.stdout.splitlines()[1:] == fresh.stdout.splitlines()[1:], how
        assert done.stderr.startswith("to stderr\n")
    assert done.returncode == -signal.SIGKILL
    done, fresh = _run(probe, "0")
    assert done.stdout.splitlines()[1:] == ["no newlinea non-daemon thread finished", "atexit handler ran"]
    done, fresh = _run(probe, "message")
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == "the probe's exit message" == \
        fresh.stderr.splitlines()[-1]
    done, fresh = _run(probe, "raise")
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == "ValueError: the probe's own error"
    assert fresh.stderr.splitlines()[-1] == done.stderr.splitlines()[-1]


def test_a_command_past_its_timeout_is_killed_as_subprocess_run_does(probe):
    with pytest.raises(subprocess.TimeoutExpired) as exc:
        cli_zygote.run_module("zygote_probe", ["hang"], dict(USUAL_ENV), str(probe), 3, USUAL_ENV)
    assert "to stderr" in exc.value.stderr
    # The zygote reaped it and serves the next command.
    done, _ = _run(probe, "0")
    assert done is not None and done.returncode == 0


def test_what_it_cannot_mirror_runs_fresh(probe, monkeypatch):
    # A variable read while importing (here PYTHONPATH), a module the zygote imported, or the switch.
    env = {**USUAL_ENV, "PYTHONPATH": str(probe)}
    assert cli_zygote.run_module("zygote_probe", ["0"], env, str(probe), 30, USUAL_ENV, passed=["PYTHONPATH"]) is None
    # Not passed by the test: the worker's own environment changed, which is worth a warning.
    with pytest.warns(UserWarning, match="differs from the zygote's in PYTHONPATH"):
        assert cli_zygote.run_module("zygote_probe", ["0"], env, str(probe), 30, USUAL_ENV) is None
    assert cli_zygote.run_module("hetpipe.training.trainer", [], dict(USUAL_ENV), str(probe), 30, USUAL_ENV) is None
    monkeypatch.setenv("HETPIPE_TEST_FRESH_PYTHON", "1")
    assert cli_zygote.run_module("zygote_probe", ["0"], dict(USUAL_ENV), str(probe), 30, USUAL_ENV) is None


def test_variables_code_in_the_worker_sets_for_itself_keep_commands_forked(probe, monkeypatch):
    # torch writes TORCHINDUCTOR_CACHE_DIR when a test compiles in the worker, and hetpipe's
    # Mooncake check MC_LOG_LEVEL while the tests are collected: with either, every later
    # command of a suite run used to start fresh.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(probe / "inductor"))
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    done, fresh = _run(probe, "0", env={"TORCHINDUCTOR_CACHE_DIR": str(probe / "inductor"), "MC_LOG_LEVEL": "ERROR"})
    assert done is not None, "the zygote was not used"
    assert done.returncode == fresh.returncode == 0


NAMESPACE_PROBE = """
import json, os, socket, sys
print(json.dumps({"nics": sorted(name for _, name in socket.if_nameindex()), "mounted": os.path.exists(sys.argv[1]),
                  "preloaded": "torch" in sys.modules}))
sys.exit(int(sys.argv[2]))
"""


def test_a_script_given_the_shim_runs_its_commands_forked_in_its_own_namespaces(tmp_path):
    # A script's `$PYTHON -m MODULE` through the shim (scripts/determinism_check.sh, an
    # emulated node's scripts/launch_cluster.sh): inside new network and mount namespaces,
    # as `ip netns exec` makes, it sees only that network and that mount, and exits as the
    # script's own interpreter would; `-c` runs the interpreter itself.
    (tmp_path / "ns_probe.py").write_text(NAMESPACE_PROBE)
    (tmp_path / "mnt").mkdir()
    script = ('mount -t tmpfs none "$1/mnt" && touch "$1/mnt/seen" && cd "$1" || exit 9\n'
              '"$PYTHON" -m ns_probe "$1/mnt/seen" 0\n"$PYTHON" -m ns_probe "$1/mnt/seen" 5\necho "status $?"\n'
              '"$PYTHON" -c "import sys; print(sys.flags.no_site)"\n')
    shim = cli_zygote.python_shim(USUAL_ENV)
    runs = {}
    for python in (shim, sys.executable):
        runs[python] = subprocess.run(["unshare", "--net", "--mount", "bash", "-c", script, "probe", str(tmp_path)],
                                      env={**USUAL_ENV, "PYTHON": python}, text=True, capture_output=True, timeout=60)
    lines = {python: run.stdout.splitlines() for python, run in runs.items()}
    assert runs[shim].returncode == 0, runs[shim].stderr
    assert lines[shim][2:] == lines[sys.executable][2:] == ["status 5", "0"]
    forked, fresh = json.loads(lines[shim][0]), json.loads(lines[sys.executable][0])
    assert forked["nics"] == fresh["nics"] == ["lo"] and forked["mounted"] and fresh["mounted"]
    assert forked["preloaded"] and not fresh["preloaded"], "the shim's command did not come from the zygote"
    assert not os.path.exists(tmp_path / "mnt" / "seen"), "the mount reached the worker's namespace"


def test_a_killed_shim_takes_its_command_with_it(probe):
    # A command whose caller is gone (a test's cleanup killed the shim) must not run on unseen.
    shim = cli_zygote.python_shim(USUAL_ENV)
    proc = subprocess.Popen([shim, "-m", "zygote_probe", "hang"], cwd=probe, env=dict(USUAL_ENV), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    command = json.loads(proc.stdout.readline())["pid"]
    assert command != proc.pid, "the shim's command did not come from the zygote"
    proc.kill()
    proc.wait(10)
    gone_by = time.monotonic() + 10
    while os.path.exists(f"/proc/{command}") and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{command}"), "the command outlived its shim"


SCRIPT_PROBE = """
import json, multiprocessing, os, sys
import sibling


def child(queue):
    queue.put(sibling.WORD)


if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    proc.start()
    print(json.dumps({"argv": sys.argv, "file": __file__, "path0": sys.path[0], "spawned": queue.get(timeout=60),
                      "preloaded": "torch" in sys.modules}))
    proc.join()
    sys.exit(int(sys.argv[1]))
"""


def test_a_script_by_path_runs_forked_as_python_runs_it(tmp_path):
    # `python scripts/bench_....py ARGS` through the shim: the script's directory first on
    # sys.path (its sibling modules import), __main__, its argv, and a spawned child that
    # imports the script again as multiprocessing does; its exit status.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "script_probe.py").write_text(SCRIPT_PROBE)
    (tmp_path / "scripts" / "sibling.py").write_text("WORD = 'from the sibling'\n")
    runs = {python: subprocess.run([python, "scripts/script_probe.py", "4", "--flag"], cwd=tmp_path,
                                   env=dict(USUAL_ENV), text=True, capture_output=True, timeout=90)
            for python in (cli_zygote.python_shim(USUAL_ENV), sys.executable)}
    (forked, fresh) = [json.loads(run.stdout.splitlines()[0]) for run in runs.values()]
    assert [run.returncode for run in runs.values()] == [4, 4], [run.stderr for run in runs.values()]
    assert forked["preloaded"] and not fresh["preloaded"], "the script did not run in the zygote's fork"
    assert forked | {"preloaded": 0} == fresh | {"preloaded": 0}
    assert forked["spawned"] == "from the sibling" and forked["argv"] == ["scripts/script_probe.py", "4", "--flag"]
