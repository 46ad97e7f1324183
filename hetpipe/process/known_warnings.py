"""torch's warnings about what hetpipe does on purpose, silenced one message at a time.

A two-GPU run on torch 2.11 printed, per rank and before hetpipe's first line,
five warnings about choices hetpipe made deliberately (issue 31, point 9).
Each is silenced here by its own message (never a category or all warnings),
and where the choice matters to the user hetpipe says so in its own line:

* "unbatched P2P op ... serialized with all other ops on this ProcessGroup":
  every NCCL boundary direction has a process group of its own
  (:meth:`hetpipe.training.topology.Topology.init_process_groups`), so nothing else is
  serialized behind its sends; torch's own switch turns it off
  (``TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING``, set only where the
  user has not set it).
* "Attempting to run cuBLAS, but there was no current CUDA context": autograd's
  device thread makes the primary context at its first GEMM, which is the
  context every other kernel of the rank uses; nothing to act on.
* "Setting the SM carveout for matmuls is a temporary experimental
  mitigation" and "preferred_blas_library is an experimental feature": printed
  by torch's C++ side while the GEMM SM carveout is set, which hetpipe does
  only with NCCL boundaries (``cluster.transport.gemm_sm_carveout``); the
  run's banner line says how many SMs the GEMMs leave to them.
* "backend_options._timeout was specified, but timeout kwarg has a default
  value": not silenced but avoided; capped boundary communicators now carry
  the group's timeout in their options (:func:`hetpipe.process.torch_compat.nccl_group_options`).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from typing import Iterator, Sequence

P2P_SERIALIZATION_SWITCH = "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"
NO_CUDA_CONTEXT = "Attempting to run cuBLAS, but there was no current CUDA context"
SM_CARVEOUT = (re.compile(r"Setting the SM carveout for matmuls is a temporary experimental mitigation"),
               re.compile(r"preferred_blas_library is an experimental feature"))


def quiet_known_warnings() -> None:
    """Silence, in this rank, the torch warnings listed above that arrive as Python warnings or
    that torch's own switches turn off; call before the first process group and kernel."""
    os.environ.setdefault(P2P_SERIALIZATION_SWITCH, "false")
    warnings.filterwarnings("ignore", message=re.escape(NO_CUDA_CONTEXT), category=UserWarning)


@contextlib.contextmanager
def native_lines_hidden(patterns: Sequence[re.Pattern]) -> Iterator[None]:
    """Run the body with the process's standard error (file descriptor 2, where torch's C++
    side writes its warnings) captured; afterwards write back every line that matches none
    of ``patterns``, so only the known lines are dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with warnings.catch_warnings():  # the same messages where a build routes them to Python
                for pattern in patterns:
                    warnings.filterwarnings("ignore", message=f".*{pattern.pattern}")
                yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            _write_unmatched(captured.read().decode(errors="replace"), patterns)


def _write_unmatched(text: str, patterns: Sequence[re.Pattern]) -> None:
    kept = [line for line in text.splitlines(keepends=True) if not any(p.search(line) for p in patterns)]
    if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()
