"""The torch releases hetpipe supports, and every private torch name it uses.

**Supported releases**: :data:`TORCH_RANGE`, the oldest and newest minor
release tested (pyproject.toml states the same range; a test holds them
equal). CI runs the whole suite on the default build and the multi-process
subset on the oldest and newest (``scripts/torch_matrix.sh``). An entry point
refuses a torch outside the range in one line, exit 2
(:func:`require_supported_torch`); ``HETPIPE_ALLOW_ANY_TORCH=1`` lets an expert
try anyway, with a warning.

**Private names live here and nowhere else** (tests/test_torch_compat.py parses
every module of the package and the scripts, and fails on a private torch name
outside this file). A private name may change in any release; each use below
says why no public API does the job, and what a release that lacks it gets:

=====================================================  ==========================================
private name                                           why, and where a build lacks it
=====================================================  ==========================================
``LocalElasticAgent._rendezvous / _start_workers /     hetpipe's launcher additions (the root
_monitor_workers / _restart_workers / _shutdown``,     cause, restart lines, each attempt's
``_remaining_restarts``, ``_worker_group``             environment): torch's agent has no hooks.
                                                       :class:`AgentHooks` overrides them with
                                                       whatever arguments the running release
                                                       passes (2.11's ``_shutdown`` takes no
                                                       ``timeout``; 2.13 added it) and offers
                                                       public-named hooks instead.
c10d rendezvous handler ``_state_holder.state.round``  the rendezvous round, equal on every node
                                                       (:func:`rendezvous_round`); None where a
                                                       handler lacks it (the agent then counts
                                                       its own restarts).
c10d rendezvous handler ``_create_tcp_store_server``   the store the agent shares with the ranks,
                                                       made on a socket bound to their
                                                       ``MASTER_ADDR`` instead of every interface
                                                       (:func:`make_agent_store_with`); a handler
                                                       without it keeps torch's store.
c10d rendezvous handler                                the store's timeout, which bounds the
``_state_holder._backend._store``                      handler's calls while and after the workers
                                                       run (:func:`bound_rendezvous_calls`); a
                                                       handler without it is left unbounded.
``torch._C._set_sm_carveout_experimental``             the GEMM SM carveout
                                                       (:func:`set_gemm_sm_carveout`); a build
                                                       without it runs with no carveout, said
                                                       in one line.
``ProcessGroupNCCL.Options._timeout``                  a capped boundary communicator's options
                                                       carry its group's timeout (torch warns
                                                       when they differ and has no public
                                                       setter): :func:`nccl_group_options`;
                                                       a build without it keeps its default.
``torch.utils._triton.has_triton``                     whether Triton can compile here
                                                       (:func:`triton_available`).
``torch._functorch.config.donated_buffer``             compiled backwards that allow
                                                       ``retain_graph`` (zero-bubble's B), see
                                                       :func:`disable_donated_buffers`.
``torch._foreach_norm / _foreach_mul_ /                one fused kernel per list instead of one
_foreach_copy_``                                       per tensor (gradient norms, clipping, the
                                                       bf16 working copies); the same kernels
                                                       ``clip_grad_norm_`` runs.
``nn.Module._parameters``                              swapping a parameter for a plain tensor
                                                       (bf16 working copies, recomputation)
                                                       without ``__setattr__``'s Parameter check.
``Tensor._post_accumulate_grad_hooks``                 running a parameter's post-accumulate
                                                       hooks after a fused weight-gradient GEMM
                                                       wrote ``.grad`` outside autograd.
``torch.cuda.memory._record_memory_history /           the caching allocator's history of one
_snapshot``                                            step (``train.memory_snapshot_step``,
                                                       hetpipe/observe/memory_peak.py): torch's only way
                                                       to say what holds device memory at a
                                                       peak; pytorch.org/memory_viz reads it.
``torch._dynamo.utils.counters``                       the compiled-graph count bench_layer
                                                       prints (:func:`compiled_graph_count`).
``dynamic_rendezvous.get_method_name``                 not private by name, but torch's own
                                                       helper: it names each rendezvous event
                                                       with two ``inspect.stack()`` calls, which
                                                       read the source of every frame, even
                                                       when no handler records the event
                                                       (:func:`cheap_rendezvous_event_names`
                                                       puts a frame lookup with the same answer
                                                       in its place); a release without it is
                                                       left alone.
``multiprocessing.forkserver._forkserver.``            the standard library's, not torch's: the
``_forkserver_pid``                                    local ranks' fork server, SIGKILLed at
                                                       exit (hetpipe.launch); None where it is
                                                       absent: the server then leaves by itself.
=====================================================  ==========================================
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.constants as dist_constants
from torch import nn
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

# The oldest and newest minor releases CI runs (scripts/torch_matrix.sh). The
# oldest is the lent GPU machines' build (2.11.0+cu130); 2.15 is the newest on
# the package index (2026-11). Older releases are not tested and so not claimed.
TORCH_RANGE = ((2, 11), (2, 15))
ALLOW_ENV = "HETPIPE_ALLOW_ANY_TORCH"


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``2.11.0+cu130`` -> ``(2, 11)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_RANGE
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def unsupported_torch(version: Optional[str] = None) -> Optional[str]:
    """Why ``version`` (default: this process's torch) is outside the supported range, or None."""
    version = version or torch.__version__
    if TORCH_RANGE[0] <= torch_release(version) <= TORCH_RANGE[1]:
        return None
    return (f"torch {version} is outside the releases hetpipe supports ({range_text()}, tested in CI): "
            f"install one of them (scripts/setup_env.sh takes HETPIPE_TORCH=torch==X.Y.Z), or set "
            f"{ALLOW_ENV}=1 to try this one anyway")


def require_supported_torch() -> None:
    """An entry point's first check: one line and exit 2 for a torch outside the range,
    a one-line warning instead under ``HETPIPE_ALLOW_ANY_TORCH=1`` (once per node)."""
    problem = unsupported_torch()
    if problem is None:
        return
    if os.environ.get(ALLOW_ENV) != "1":
        from hetpipe.errors import fail

        fail(problem)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        os.write(sys.stderr.fileno(), f"hetpipe: warning: torch {torch.__version__} is not a supported release "
                 f"({range_text()}); running anyway because {ALLOW_ENV}=1\n".encode())


def feature_off(message: str) -> None:
    """One line for a feature this torch build lacks (printed once per process)."""
    _say_once(f"hetpipe: note: {message}")


@functools.lru_cache(maxsize=None)
def _say_once(line: str) -> None:
    os.write(sys.stderr.fileno(), (line + "\n").encode())


# -- torch's elastic agent ---------------------------------------------------------------------

# 2.13 gave the agent's _shutdown a timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
# torchrun's --shutdown-timeout); 2.11 stops ranks after a fixed 30 s.
SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters


class AgentHooks(LocalElasticAgent):
    """torch's local elastic agent with public hooks where hetpipe's launcher adds
    its work. The private methods overridden below pass on whatever arguments the
    running torch release calls them with."""

    # -- hooks for subclasses ------------------------------------------------------------
    def after_rendezvous(self, worker_group: WorkerGroup) -> None:
        """The ranks of the next attempt have their world; they have not started."""

    def worker_env(self) -> dict[str, str]:
        """Variables every worker of the attempt being started gets."""
        return {}

    def after_start(self, worker_group: WorkerGroup, pids: dict[int, Any]) -> None:
        """The workers run (``pids``: local rank -> pid)."""

    def after_monitor(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """torch's agent polled the workers and got ``result``."""

    def before_restart(self, worker_group: WorkerGroup) -> None:
        """The attempt failed (or another node's did) and a restart follows."""

    def before_shutdown(self) -> None:
        """The agent is about to stop every worker it has."""

    @property
    def remaining_restarts(self) -> int:
        return self._remaining_restarts

    def stop_restarting(self) -> None:
        """No restart follows this attempt's failure: torch's agent then stops the workers
        and raises the failure (its restart loop reads this count after the monitor)."""
        self._remaining_restarts = 0

    @property
    def worker_group(self) -> WorkerGroup:
        return self._worker_group

    # -- torch's private methods --------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        cheap_rendezvous_event_names()
        super()._rendezvous(worker_group, *args, **kwargs)
        bound_rendezvous_calls(worker_group.spec.rdzv_handler)
        self.after_rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> dict[int, Any]:
        # torch builds each worker's environment from this process's (both start methods).
        with _environ(self.worker_env()):
            pids = super()._start_workers(worker_group, *args, **kwargs)
        self.after_start(worker_group, pids)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> RunResult:
        result = super()._monitor_workers(worker_group, *args, **kwargs)
        self.after_monitor(worker_group, result)
        return result

    def _restart_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.before_restart(worker_group)
        super()._restart_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.before_shutdown()
        super()._shutdown(*args, **kwargs)


def cheap_rendezvous_event_names() -> None:
    """Name torch's c10d rendezvous events by a frame lookup instead of ``inspect.stack()``.

    torch names every event its rendezvous records (joining, keep-alive, closing) with
    ``get_method_name``, which builds the whole stack with source context twice per
    event, and ``inspect.getmodule`` walks every loaded module for a frame without a
    module file, although no handler records most of these events (the cost of one
    launch: docs/benchmarks.md, "The suite's time").
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name(depth)`` returns: the name of the function ``depth``
    frames up from this one, or ``no_method_name`` past the stack's end."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


# What the handler's calls return once its store is lost: nobody waits to join
# (nobody can reach the store), and its shutdown did not happen.
_BOUNDED_RENDEZVOUS_CALLS = (("num_nodes_waiting", 0), ("shutdown", False))
# At most this long for one of them, as the launcher's own store client waits
# (hetpipe/launch/agent.py): each is one small store request, answered in
# milliseconds, while the store's own timeout (the rendezvous' read_timeout,
# 600 s by launch_cluster.sh's default so that nodes may start minutes apart)
# would keep a launcher whose ranks all exited waiting ten minutes.
_RENDEZVOUS_CALL_CAP_S = 5.0


def bound_rendezvous_calls(handler: Any) -> None:
    """Bound the calls torch's agent makes on the rendezvous handler while its workers run
    and after they ended by the handler's store timeout (the rendezvous' ``read_timeout``),
    at most ``_RENDEZVOUS_CALL_CAP_S``.

    torch's TCPStore client does not hold its timeout once the route to the store
    is gone: a request waits for TCP's retransmission timeout, about 15 minutes
    (issue 32). The agent asks the store how many nodes wait to join after every
    poll of its workers, so a node whose NIC to the store went down kept its
    launcher in that call after its ranks had exited. A call that overruns is
    left on its thread, answers as if nobody waited, and every later one answers
    at once. So does one that fails: the store's host left (node 0's launcher
    exits as soon as its ranks did), and this node's ranks, which stop on it
    too, say why - where the failure raised here ended the launcher with status
    1 and "lost the rendezvous store" before it saw its ranks' status 3.
    """
    store = getattr(getattr(getattr(handler, "_state_holder", None), "_backend", None), "_store", None)
    timeout = getattr(store, "timeout", None)
    if timeout is None or getattr(handler, "_hetpipe_bounded", False):
        return
    lost = threading.Event()
    for name, fallback in _BOUNDED_RENDEZVOUS_CALLS:
        limit = min(timeout.total_seconds(), _RENDEZVOUS_CALL_CAP_S)
        setattr(handler, name, _within(getattr(handler, name), limit, fallback, lost))
    handler._hetpipe_bounded = True


def _within(call: Callable[..., Any], limit: float, fallback: Any, lost: threading.Event) -> Callable[..., Any]:
    """``call`` on a thread of its own, ``fallback`` if it overruns ``limit`` s or overran before."""
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if lost.is_set():
            return fallback
        box: dict[str, Any] = {}
        thread = threading.Thread(target=_into, args=(box, call, args, kwargs), daemon=True,
                                  name="hetpipe-rendezvous-call")
        thread.start()
        thread.join(limit)
        if thread.is_alive() or isinstance(box.get("error"), Exception):
            lost.set()
            return fallback
        if "error" in box:
            raise box["error"]
        return box["value"]
    return bounded


def _into(box: dict[str, Any], call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    try:
        box["value"] = call(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
        box["error"] = exc


def agent_can_set_shutdown_timeout() -> bool:
    """Whether this torch honours ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; when it is set and
    not honoured, one line says so."""
    if not SHUTDOWN_TAKES_TIMEOUT and os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        feature_off(f"torch {torch.__version__} ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT (added in 2.13): its "
                    "agent gives ranks 30 s after a stop signal before SIGKILL")
    return SHUTDOWN_TAKES_TIMEOUT


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rendezvous_round(handler: Any) -> Optional[int]:
    """The round of torch's c10d (dynamic) rendezvous ``handler`` - the same on every
    node - or None for a handler that keeps no such state."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    return getattr(state, "round", None)


def make_agent_store_with(handler: Any, make: Callable[[str, int], Any]) -> bool:
    """Have torch's c10d rendezvous ``handler`` make the store it shares with the workers as
    ``make(host, port)`` - ``host`` what the workers get as ``MASTER_ADDR``, ``port`` 0 - rather
    than as a TCPStore on every interface. False (torch's store) where it makes none itself."""
    if not callable(getattr(handler, "_create_tcp_store_server", None)):
        return False
    handler._create_tcp_store_server = make
    return True


# What a local rank imports before its first step, for the server local ranks
# fork from (hetpipe.launch): torch, and the compiler torch's optimizer
# constructor imports (``torch._dynamo``, through ``torch._disable_dynamo``).
RANK_PRELOAD = ["torch", "torch._dynamo"]


# -- kernels and compiler switches ----------------------------------------------------------------

def set_gemm_sm_carveout(sms: int) -> bool:
    """Leave ``sms`` SMs out of cuBLASLt's GEMMs; False (and one line) where this build cannot."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        feature_off(f"torch {torch.__version__} has no GEMM SM carveout: "
                    "cluster.transport.gemm_sm_carveout is off")
        return False
    setter(sms)
    return True


# What torch gives an NCCL group created with no timeout (torch.distributed.constants:
# None on a build without NCCL, which never creates one).
NCCL_DEFAULT_TIMEOUT = dist_constants.default_pg_nccl_timeout or dist_constants.default_pg_timeout


def nccl_group_options(max_ctas: int, timeout: timedelta) -> "dist.ProcessGroupNCCL.Options":
    """Options of an NCCL group whose communicator uses at most ``max_ctas`` CTAs, with the
    ``timeout`` the group is created with (else torch warns that the two disagree)."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    if hasattr(options, "_timeout"):
        options._timeout = timeout
    return options


def triton_available() -> bool:
    """Whether Triton can compile kernels for this process's GPU."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def disable_donated_buffers() -> None:
    """Compiled backwards keep their saved buffers, so a backward may retain its graph."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def donated_buffers_off() -> contextlib.AbstractContextManager:
    """:func:`disable_donated_buffers` inside a block only."""
    import torch._functorch.config

    return torch._functorch.config.patch(donated_buffer=False)


def reset_compiler() -> None:
    """Forget every compiled graph, and the counters :func:`compiled_graph_count` reads."""
    import torch._dynamo

    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()


def compiled_graph_count() -> int:
    """Graphs compiled since :func:`reset_compiler`."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def foreach_norm(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Each tensor's 2-norm, in one kernel per device and dtype."""
    if dtype is None:
        return list(torch._foreach_norm(list(tensors), 2))
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: torch.Tensor) -> None:
    torch._foreach_mul_(list(tensors), scalar)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    torch._foreach_copy_(list(dst), list(src))


# -- device memory --------------------------------------------------------------------------------

def record_allocator_history(max_entries: Optional[int]) -> None:
    """Record every allocation and free on the current CUDA device, with its Python stack
    (a fresh history), until called with None."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=max_entries, clear_history=True)


def allocator_snapshot() -> dict[str, Any]:
    """The allocator's segments and recorded history (the ``device_traces`` per device)."""
    return torch.cuda.memory._snapshot()


# -- modules and parameters -----------------------------------------------------------------------

def own_parameters(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameter slots (name -> tensor or None), writable: a plain
    tensor stored here replaces the parameter without ``__setattr__``'s check."""
    return module._parameters


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """The hooks ``param.register_post_accumulate_grad_hook`` added, run as autograd would
    after accumulating into ``param.grad``."""
    hooks: Optional[dict[Any, Callable[[torch.Tensor], None]]] = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list((hooks or {}).values()):
        hook(param)


def fork_server_pid() -> Optional[int]:
    """The pid of multiprocessing's fork server, if this process started one
    (the standard library offers no public way to it)."""
    import multiprocessing.forkserver

    return getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None)
