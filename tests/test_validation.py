"""Validation through the user's entry point: val_loss forward-only through the
same pipeline, on data.split's held-out documents or data.valid_path.

The reference is the single-process run. A run split across vendors (PP2 over
the tcp channel) or over DP replicas must log the same val_loss bitwise (CPU,
fp32): its weights are bitwise the reference's (one microbatch per DP rank
keeps DP training bitwise too) and the losses are combined in one order.
"""
import math

import numpy as np
import pytest

from conftest import run_cli, run_pretrain
from hetpipe.data.indexed import IndexedDataset
from hetpipe.data.loader import MicrobatchLoader
from hetpipe.data.split import parse_split, split_documents
from hetpipe.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

STEPS = 6
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160",
          f"train.train_iters={STEPS}", "train.seq_length=32", "train.micro_batch_size=2",
          "train.global_batch_size=4", "train.log_interval=10", "optimizer.lr=3e-3",
          "optimizer.clip_grad=0.5", "cluster.groups.0.device_type=CPU", "logging.progress=false",
          "data.split='90,10,0'", "train.eval_interval=4", "train.eval_iters=3"]


def _run(run_dir, data, *overrides):
    """(training rows, validation rows) of one run."""
    _, rows = run_pretrain(run_dir, [*COMMON, f"data.path={data}", *overrides])
    train = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"], r["val_ppl"]) for r in rows if "val_loss" in r]
    return train, val


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    return _run(tmp_path_factory.mktemp("ref") / "single", corpus_prefix)


def test_single_process_validates_at_the_interval_and_at_the_end(reference):
    train, val = reference
    assert [step for step, _, _ in train] == list(range(1, STEPS + 1))
    assert [step for step, _, _ in val] == [4, STEPS]
    for _, loss, ppl in val:
        assert ppl == pytest.approx(math.exp(loss), rel=1e-12)
    # Same batches each time, better weights: the held-out loss went down.
    assert val[1][1] < val[0][1]


@pytest.mark.parametrize("layout", [
    ["cluster=cpu_mixed", "cluster.transport.kind=tcp", "partition.layers=[1,3]"],
    ["cluster=cpu_homogeneous", "partition.dp=2"],
    # Two of the four ranks hold no loss: only each replica's last stage reports.
    ["cluster=cpu_mixed", "cluster.groups.0.ranks_per_node=2", "cluster.groups.1.ranks_per_node=2",
     "partition.dp=2", "partition.layers=[1,3]", "optimizer.distributed=true"],
    # ZB-V's forward-only order in a V: rank 0 both embeds and reports the loss.
    ["cluster=cpu_mixed", "cluster.transport.kind=tcp", "partition.schedule=zb_v", "partition.num_chunks=2",
     "partition.layers=[1,1,1,1]"],
], ids=["pp2_across_vendors", "dp2", "pp2_dp2_zero1", "zb_v_across_vendors"])
def test_validation_is_bitwise_the_single_process_one(tmp_path, corpus_prefix, reference, layout):
    assert _run(tmp_path / "run", corpus_prefix, *layout) == reference


def test_split_parts_are_disjoint_megatron_document_ranges(corpus_prefix):
    docs = IndexedDataset(corpus_prefix).num_documents
    weights = parse_split("969, 30, 1")
    ranges = [split_documents(docs, weights, part) for part in ("train", "valid", "test")]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == ranges[2][0]
    assert ranges[2][1] == docs
    # Megatron's own example: 1000 documents split 90,9,1.
    assert [split_documents(1000, parse_split("90,9,1"), p) for p in ("train", "valid", "test")] == \
        [(0, 900), (900, 990), (990, 1000)]
    assert parse_split("99,1") == pytest.approx((0.99, 0.01, 0.0))
    # Training and validation samples come from their own documents only.
    common = dict(tokenizer_spec="byte", seq_length=32, global_batch_size=4, micro_batch_size=2, vocab_size=257)
    train = MicrobatchLoader(corpus_prefix, split="90,10,0", **common)
    valid = MicrobatchLoader(corpus_prefix, split="90,10,0", part="valid", **common)
    whole = MicrobatchLoader(corpus_prefix, **common)
    assert train.samples.num_samples + valid.samples.num_samples <= whole.samples.num_samples
    first, _ = valid.next_step()[0]
    valid.restart()
    again, _ = valid.next_step()[0]
    assert np.array_equal(first, again)


@pytest.mark.parametrize("spec", ["90;10", "90,10,0,0", "-1,1", "0,0,0", "a,b"])
def test_bad_split_strings_are_refused(spec):
    with pytest.raises(ConfigError, match="must be up to three non-negative numbers"):
        parse_split(spec)


@pytest.mark.parametrize("overrides, message", [
    (["data.split=null"], "train.eval_interval=4 needs validation data: set data.split"),
    (["data.split='90;10'"], "data.split='90;10' must be up to three non-negative numbers"),
    ([f"data.valid_path={'{data}'}"], "data.split and data.valid_path both choose the validation data"),
    (["data.split='100,0,0'"], "leaves the valid part of"),
])
def test_bad_validation_setups_are_one_clear_line(tmp_path, corpus_prefix, overrides, message):
    overrides = [o.replace("{data}", corpus_prefix) for o in overrides]
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}",
                    f"hydra.run.dir={tmp_path}", *overrides])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
