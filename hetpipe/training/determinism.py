"""``train.deterministic``: two runs of one configuration on one machine give the
same bits (Megatron's ``--deterministic-mode``, torchtitan's ``debug.deterministic``).

Without it two identical NCCL runs on two H100s differed by up to 1.8e-2
relative in loss over 200 steps (issue 31), so a channel's parity could not be
told from noise. What the mode changes, in every rank before its first
device work:

* ``torch.use_deterministic_algorithms(True)`` with ``warn_only=False``: ops
  with a deterministic variant use it (scatter_add, index_add, the embedding's
  backward on CUDA, flash attention's backward), and an op without one raises;
  :func:`refusals_reported` makes that raise one line naming the op and this
  option. It also turns on Inductor's deterministic mode (no autotuning by
  timing) for the fused elementwise kernels, and torch's default
  ``torch.utils.deterministic.fill_uninitialized_memory`` (every ``torch.empty``
  is filled) stays on. cuDNN: ``deterministic=True``, ``benchmark=False``.
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS is bitwise reproducible only with
  a fixed workspace per stream; torch refuses a GEMM under the flag without it
  and reads it once, at the process's first cuBLAS call. The launcher puts it
  in every rank's environment (``hetpipe.launch.local.launch``'s ``env``), and
  :func:`apply` says so in one line where a rank started without it after CUDA
  was up (a launcher that is not hetpipe's).
* ``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple`` (RCCL reads the same names), set
  before any communicator exists: NCCL chooses algorithm and protocol per
  collective from its tuning model, and they decide the order in which ranks'
  values are summed; NVLS (NVLink SHARP, in-switch reduction, chosen on H100
  NVSwitch systems) is known to give different sums between calls
  (NVIDIA/nccl#1497), and Ring is the one algorithm every collective hetpipe
  runs has. Simple is the protocol every algorithm has; fixing it keeps
  NCCL's tuner (and a tuner plugin) out of the chunking. The ring's order
  follows the rank-to-GPU mapping, so runs agree on one machine with one
  mapping, not across machines. ``RCCL_MSCCL_ENABLE=0``,
  ``RCCL_MSCCLPP_ENABLE=0``: RCCL's MSCCL and MSCCL++ paths pick their own
  algorithms per size, past ``NCCL_ALGO``. A variable the user set is kept.
  Point-to-point boundaries (NCCL send/recv, hetpipe's channels) move bytes
  exactly and need nothing.
* Attention: FlashAttention-4 with ``deterministic=True`` (its deterministic
  backward) where the rank runs FA4; else SDPA backends with a deterministic
  backward only, flash first (``hetpipe.models.attention``).
* No GEMM SM carveout (:func:`gemm_sm_carveout`): cuBLAS is reproducible for
  a fixed number of SMs, and the carveout leaves SMs out on ranks with an NCCL
  boundary only (and sends their GEMMs to cuBLASLt), so an NCCL run and a
  direct-channel run would choose GEMM kernels differently.

What it costs: flash attention instead of cuDNN's (torch's choice on H100 and
H200), FlashAttention-2's deterministic backward, the NCCL boundary's GEMM
carveout, ring-only collectives and filled allocations. Measured on 2x H100
(torch 2.11.0+cu130, 0.75B LLaMA-3 shape, PP2, seq 1024, 200 steps,
``scripts/determinism_check.sh``, docs/benchmarks.md): steps 1.157x longer
over NCCL, 1.123x over the direct channel, 1.112x over tcp; the two NCCL
runs, the direct and the tcp run were then bitwise identical.
On CPUs torch's kernels are deterministic already and the mode changes no
number (tests/test_determinism.py); what it checks there is only what CPU
kernels raise. Not verified on AMD hardware: RCCL's variables and ROCm's
attention backward.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from hetpipe.errors import ConfigError

if TYPE_CHECKING:
    from hetpipe.training.topology import Topology

CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
# The two settings torch accepts as deterministic (it refuses a GEMM under the flag otherwise).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
# Every rank's environment under train.deterministic, unless the user set a variable.
ENV = {CUBLAS_WORKSPACE: CUBLAS_DETERMINISTIC[0], "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
       "RCCL_MSCCL_ENABLE": "0", "RCCL_MSCCLPP_ENABLE": "0"}


def launch_env(deterministic: bool) -> dict[str, str]:
    """What a launcher adds to every rank's environment for ``train.deterministic``:
    :data:`ENV` less the variables already set here. A ``CUBLAS_WORKSPACE_CONFIG``
    torch would refuse is one line before any rank starts."""
    if not deterministic:
        return {}
    given = os.environ.get(CUBLAS_WORKSPACE)
    if given is not None and given not in CUBLAS_DETERMINISTIC:
        raise ConfigError(f"train.deterministic=true needs {CUBLAS_WORKSPACE} to be one of "
                          f"{', '.join(CUBLAS_DETERMINISTIC)} (torch refuses cuBLAS otherwise), but it is "
                          f"{given!r}: unset it or set one of them")
    return {name: value for name, value in ENV.items() if name not in os.environ}


def apply(deterministic: bool, rank: int) -> None:
    """This rank's deterministic settings, before its first device work. Also
    the non-deterministic defaults, so one process running several jobs
    (hydra's multirun) leaves no job in the last one's mode."""
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    if not deterministic:
        return
    torch.backends.cudnn.benchmark = False
    missing = launch_env(True)
    if missing and torch.cuda.is_initialized():
        print(f"hetpipe: warning: train.deterministic: rank {rank} started without {', '.join(missing)}, and "
              "CUDA was up before they could be set; cuBLAS work done earlier in this process may not be "
              "reproducible: start ranks with hetpipe's launchers or export them", file=sys.stderr, flush=True)
    os.environ.update(missing)


@contextlib.contextmanager
def refusals_reported() -> Iterator[None]:
    """torch's refusal of an op without a deterministic implementation (and of
    cuBLAS without its workspace setting) as one line naming the op and the option."""
    try:
        yield
    except RuntimeError as exc:
        line = refusal_line(str(exc))
        if line is None:
            raise
        raise ConfigError(line) from None


def refusal_line(message: str) -> str | None:
    """The one line for torch's determinism refusal ``message``; None for any other error."""
    marker = " does not have a deterministic implementation"
    if marker in message:
        op = message.split(marker)[0].split()[-1]
        return (f"train.deterministic=true: torch {torch.__version__} has no deterministic {op}, which this "
                "run needs; run with train.deterministic=false")
    if CUBLAS_WORKSPACE in message and "Deterministic behavior was enabled" in message:
        return (f"train.deterministic=true: cuBLAS ran without {CUBLAS_WORKSPACE} in this rank's environment "
                f"from its start; export {CUBLAS_WORKSPACE}={CUBLAS_DETERMINISTIC[0]}")
    return None


def gemm_sm_carveout(topo: Topology, deterministic: bool) -> int:
    """``topo``'s GEMM SM carveout, applied; none under ``train.deterministic``,
    which says so on the stage's first rank where there would have been one."""
    if not deterministic:
        return topo.apply_gemm_sm_carveout()
    if topo.gemm_sm_carveout() and topo.rank == topo.stage.ranks[0]:
        print("hetpipe: note: train.deterministic: the GEMMs leave no SMs to the NCCL boundary (no "
              "cluster.transport.gemm_sm_carveout), so they pick the kernels of a rank without one", flush=True)
    return 0


def describe(deterministic: bool) -> str:
    """The banner's words for a deterministic run (the settings its ranks run with), else none."""
    if not deterministic:
        return ""
    return "deterministic (" + ", ".join(f"{name}={os.environ.get(name, '-')}" for name in list(ENV)[:3]) + "), "


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from ``seed`` (every device's, for torch)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
