"""train.memory_snapshot_step: what was alive at a step's memory peak, from the allocator's trace."""
import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.observe.memory_peak import memory_snapshot_step, peak_report
from hetpipe.schema.pretrain_config import TrainConfig

MIB = 2**20


def _frames(*where):
    """A stack, innermost first, as the allocator records it (torch's own frames inside)."""
    return [{"filename": "/venv/lib/python3.11/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}] + [
        {"filename": f"/venv/lib/python3.11/site-packages/hetpipe/{path}", "line": line, "name": name}
        for path, line, name in where]


def _alloc(addr, mib, *where):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": _frames(*where)}


def _free(addr, mib):
    return {"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}


def test_the_report_names_what_was_alive_at_the_peak_not_at_the_end():
    fwd = (("models/layers.py", 256, "forward"), ("training/engine.py", 240, "_forward"))
    recv = (("training/engine.py", 209, "_post_receives"), ("training/engine.py", 215, "_receive"))
    trace = [
        _alloc(1, 100, *fwd), _alloc(2, 100, *fwd),
        _alloc(3, 64, *recv),
        _free(900, 50),                     # a block from before the step (an old gradient)
        _alloc(4, 300, ("models/loss.py", 80, "chunked_loss"), ("training/engine.py", 250, "_forward")),
        # the peak: 100 + 100 + 64 - 50 + 300 = 514 MiB over the step's start
        _free(4, 300), _free(1, 100),
        _alloc(5, 200, *fwd),               # 314 at most afterwards: not the peak
        {"action": "free_completed", "addr": 4, "size": 300 * MIB, "frames": []},  # not counted twice
    ]
    text = peak_report(trace, before=1024 * MIB, rank=1, step=3)
    lines = text.splitlines()
    assert lines[0] == ("rank 1, step 3: peak allocated 1.50 GiB; 1.00 GiB allocated when the step began, "
                        "0.95 GiB of it still at the peak; 0.50 GiB allocated in the step and alive at the peak "
                        "(4 blocks)")
    rows = [line.split() for line in lines[4:]]
    # Largest first: the loss's 300 MiB, the forward's 200 in two blocks, the receive's 64.
    assert [(r[0], r[1], r[2]) for r in rows] == [("0.293", "1", "_forward"), ("0.195", "2", "_forward"),
                                                  ("0.062", "1", "_post_receives")]
    assert lines[4].endswith("_forward | hetpipe/models/loss.py:80 chunked_loss")
    assert lines[6].endswith("_post_receives | hetpipe/training/engine.py:209 _post_receives")


def test_memory_snapshot_step_is_checked_and_writes_nothing_without_a_gpu(tmp_path):
    with pytest.raises(ConfigError, match="train.memory_snapshot_step=0 must be a step number"):
        TrainConfig(memory_snapshot_step=0)
    if torch.cuda.is_available():
        pytest.skip("a GPU machine records for real")
    with memory_snapshot_step(True, tmp_path, 0, 1):
        torch.ones(4)
    assert not list(tmp_path.iterdir())
