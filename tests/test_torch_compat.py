"""The supported torch range, and private torch names kept in hetpipe/process/torch_compat.py.

Runs on every torch CI tests (marker ``torch_matrix``: scripts/torch_matrix.sh
runs it on the range's oldest and newest release)."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

import hetpipe
from hetpipe.process import torch_compat
from hetpipe.process.torch_compat import TORCH_RANGE, torch_release, unsupported_torch

from conftest import REPO

pytestmark = pytest.mark.torch_matrix

ADAPTER = REPO / "hetpipe" / "process" / "torch_compat.py"
SCANNED = ("hetpipe", "models", "partitioner", "comm", "scripts")
# Private names of the standard library that are documented API.
STDLIB_PRIVATE = {("os", "_exit"), ("sys", "_getframe")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(trees: dict) -> set[str]:
    """Attribute names hetpipe's own classes and objects define: methods, class
    attributes and anything assigned as ``x.name = ...``."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        names |= {t.id for t in ast.walk(item) if isinstance(t, ast.Name)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def private_torch_uses() -> list[str]:
    """``path:line: name`` for every private name of torch (or another library)
    used outside hetpipe/process/torch_compat.py: an import path with a private part, an
    attribute no hetpipe class defines, or such a name given to getattr/hasattr."""
    trees = {p: ast.parse(p.read_text()) for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))}
    # What the adapter assigns is torch's (AgentHooks resets the agent's _remaining_restarts), not ours.
    ours = _ours({p: t for p, t in trees.items() if p != REPO / "hetpipe" / "process" / "torch_compat.py"})
    found = []
    for path, tree in trees.items():
        if path == ADAPTER:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = getattr(node, "module", None) or ""
                names = [f"{module}.{a.name}".strip(".") for a in node.names]
                names = [n for n in names if n.startswith("torch") and any(map(_private, n.split(".")))]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
                base = node.value.id if isinstance(node.value, ast.Name) else None
                if (base, node.attr) not in STDLIB_PRIVATE:
                    names = [node.attr]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and node.args[1].value not in ours):
                names = [node.args[1].value]
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {name}" for name in names]
    return found


def test_no_private_torch_name_outside_the_adapter():
    assert private_torch_uses() == []


def test_the_scan_finds_a_private_name_where_one_is_used(tmp_path, monkeypatch):
    """The scan itself: the adapter's own uses are what it would report elsewhere."""
    monkeypatch.setattr(sys.modules[__name__], "ADAPTER", tmp_path / "none.py")
    found = private_torch_uses()
    assert any("torch_compat.py" in f and "_foreach_norm" in f for f in found)
    assert any("torch_compat.py" in f and "_remaining_restarts" in f for f in found)
    assert any("torch_compat.py" in f and "torch.utils._triton" in f for f in found)


def _hetpipe_classes():
    for info in pkgutil.walk_packages(hetpipe.__path__, "hetpipe."):
        if info.name.endswith(("__main__", "torch_compat")):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name:
                yield cls


def test_no_hetpipe_class_overrides_a_private_member_of_a_torch_class():
    """A subclass of a torch class that defines a private name torch's class also
    has overrides (or shadows) torch's private API; only the adapter may. (Names a
    metaclass adds, such as autograd's ``_backward_cls``, are not in the source.)"""
    clashes = []
    for cls in _hetpipe_classes():
        torch_bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("torch")]
        if not torch_bases:
            continue
        body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body[0].body
        written = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        written |= {t.id for n in body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in ast.walk(n)
                    if isinstance(t, ast.Name)}
        for name in written:
            if _private(name) and any(name in vars(b) for b in torch_bases):
                clashes.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert clashes == []


def test_the_adapters_agent_overrides_what_this_torch_calls():
    """Every private method AgentHooks overrides exists on this torch's agent (so the
    override runs), and the attributes it reads are set by torch's constructor."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    overridden = [n for n in vars(torch_compat.AgentHooks) if _private(n) and callable(vars(torch_compat.AgentHooks)[n])]
    assert sorted(overridden) == ["_monitor_workers", "_rendezvous", "_restart_workers", "_shutdown",
                                  "_start_workers"]
    assert all(callable(getattr(LocalElasticAgent, n, None)) for n in overridden)
    init = inspect.getsource(inspect.getmro(LocalElasticAgent)[1].__init__)
    assert "self._remaining_restarts" in init and "self._worker_group" in init
    takes = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
    assert torch_compat.SHUTDOWN_TAKES_TIMEOUT == takes
    assert takes == (torch_release(torch.__version__) >= (2, 13))


def test_the_rendezvous_round_is_read_from_a_real_c10d_handler():
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id="compat", min_nodes=1,
                                  max_nodes=1, is_host="true")
    handler = get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        first = torch_compat.rendezvous_round(handler)
        assert isinstance(first, int)
    finally:
        handler.shutdown()
    assert torch_compat.rendezvous_round(object()) is None


def _rendezvous_event_names(monkeypatch, run_id: str) -> list[str]:
    """The names a real c10d handler gives the events of one rendezvous and its shutdown."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    names = []
    monkeypatch.setattr(dynamic_rendezvous, "construct_and_record_rdzv_event",
                        lambda **event: names.append(event["name"]))
    handler = get_rendezvous_handler(RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id=run_id,
                                                          min_nodes=1, max_nodes=1, is_host="true"))
    try:
        handler.next_rendezvous()
    finally:
        handler.shutdown()
    return names


def test_rendezvous_events_keep_torchs_names_without_its_stack_walk(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert dynamic_rendezvous.get_method_name.__module__ == dynamic_rendezvous.__name__  # torch's own, here
    torchs = _rendezvous_event_names(monkeypatch, "names-torch")
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    torch_compat.cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is torch_compat._method_name
    ours = _rendezvous_event_names(monkeypatch, "names-ours")
    assert ours == torchs and len(torchs) >= 3
    assert any(name.endswith("._add_to_participants") for name in ours), ours
    assert torch_compat._method_name(10_000) == "no_method_name"


def test_the_agent_store_of_a_real_c10d_handler_is_made_by_hetpipe():
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    made = []

    def make(host, port):
        made.append((host, port))
        return torch.distributed.TCPStore(host, port, is_master=True, multi_tenant=True)

    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id="compat-store", min_nodes=1,
                                  max_nodes=1, is_host="true", local_addr="127.0.0.1")
    handler = get_rendezvous_handler(params)
    try:
        assert torch_compat.make_agent_store_with(handler, make)
        info = handler.next_rendezvous()
        assert made == [("127.0.0.1", 0)] and info.bootstrap_store_info.master_addr == "127.0.0.1"
    finally:
        handler.shutdown()
    assert torch_compat.make_agent_store_with(object(), make) is False


def test_a_missing_sm_carveout_is_one_line_and_off(monkeypatch, capfd):
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental", raising=False)
    torch_compat._say_once.cache_clear()
    assert torch_compat.set_gemm_sm_carveout(8) is False
    assert torch_compat.set_gemm_sm_carveout(8) is False
    err = capfd.readouterr().err
    assert err.count("hetpipe: note:") == 1 and "gemm_sm_carveout is off" in err


def test_a_shutdown_timeout_this_torch_ignores_is_said_once(monkeypatch, capfd):
    monkeypatch.setattr(torch_compat, "SHUTDOWN_TAKES_TIMEOUT", False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    torch_compat._say_once.cache_clear()
    assert torch_compat.agent_can_set_shutdown_timeout() is False
    assert torch_compat.agent_can_set_shutdown_timeout() is False
    err = capfd.readouterr().err
    assert err.count("ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT (added in 2.13)") == 1
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    torch_compat._say_once.cache_clear()
    torch_compat.agent_can_set_shutdown_timeout()
    assert capfd.readouterr().err == ""


def test_kernels_and_switches_work_on_this_torch():
    xs = [torch.randn(5, 3), torch.randn(7)]
    norms = torch_compat.foreach_norm(xs, dtype=torch.float32)
    assert all(torch.allclose(n, torch.linalg.vector_norm(x)) for n, x in zip(norms, xs))
    copies = [torch.zeros_like(x) for x in xs]
    torch_compat.foreach_copy_(copies, xs)
    torch_compat.foreach_mul_(copies, torch.tensor(2.0))
    assert all(torch.equal(c, 2 * x) for c, x in zip(copies, xs))
    assert isinstance(torch_compat.triton_available(), bool)
    with torch_compat.donated_buffers_off():
        pass
    linear = torch.nn.Linear(2, 2)
    seen = []
    linear.weight.register_post_accumulate_grad_hook(seen.append)
    torch_compat.run_post_accumulate_grad_hooks(linear.weight)
    assert seen == [linear.weight]
    assert set(torch_compat.own_parameters(linear)) == {"weight", "bias"}


def test_pyproject_and_the_ci_matrix_state_the_same_range():
    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_RANGE
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"' in pyproject
    matrix = re.search(r'^versions=\(([^)]*)\)', (REPO / "scripts" / "torch_matrix.sh").read_text(), re.M)
    assert [torch_release(v) for v in matrix.group(1).split()] == list(TORCH_RANGE)
    assert unsupported_torch(torch.__version__) is None, "the suite runs on a supported torch"


@pytest.mark.parametrize("version, ok", [("2.10.1", False), ("2.11.0+cu130", True), ("2.15.0", True),
                                         ("2.16.0.dev20261101", False), ("2.13.0+rocm6.4", True)])
def test_the_range_check(version, ok):
    problem = unsupported_torch(version)
    assert (problem is None) == ok
    if not ok:
        assert f"torch {version} is outside" in problem and "2.11 to 2.15" in problem


_FAKE = ("import sys, torch; torch.__version__ = '2.10.0'; sys.argv = ['pretrain', '+model=tiny_llama', "
         "'cluster=single', 'train.train_iters=1', 'hydra.run.dir=' + sys.argv[1]]; "
         "from hetpipe.pretrain import main; main()")


def test_an_unsupported_torch_is_one_line_and_exit_2_unless_allowed(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != torch_compat.ALLOW_ENV}
    refused = subprocess.run([sys.executable, "-c", _FAKE, str(tmp_path / "a")], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "hetpipe: error: torch 2.10.0 is outside the releases hetpipe supports (2.11 to 2.15, tested in CI): "
        "install one of them (scripts/setup_env.sh takes HETPIPE_TORCH=torch==X.Y.Z), or set "
        "HETPIPE_ALLOW_ANY_TORCH=1 to try this one anyway"]
    allowed = subprocess.run([sys.executable, "-c", _FAKE, str(tmp_path / "b")], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={**env, torch_compat.ALLOW_ENV: "1"})
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "hetpipe: warning: torch 2.10.0 is not a supported release (2.11 to 2.15)" in allowed.stderr
    assert "step      1/1" in allowed.stdout
