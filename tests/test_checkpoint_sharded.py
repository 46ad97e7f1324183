"""Sharded checkpoints: every rank writes what it holds, and any plan reads it back.

Four spawned gloo ranks run a tied Qwen2 (one KV head, so TP2 replicates it)
at TP2 x DP2 with ZeRO-1 for two AdamW steps, then save twice: into one
shared directory, and into a directory per "node" (``{node}`` in save_dir,
node = DP replica), as node-local disks would be. Each rank resumes from its
own directory under the same plan, bitwise; the single test process then
reads the checkpoints whole (TP1, plain AdamW) and compares with the state
the ranks gathered, and finds what a node's directory lacks named by file and node.
"""
from __future__ import annotations

import json
import shutil
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiproc import CTX, collect

from hetpipe.checkpoint import CheckpointConfig, CheckpointError, CheckpointSaver, load_checkpoint
from hetpipe.models import build_model, model_preset
from hetpipe.models.parallelize import parallelize_tensor
from hetpipe.checkpoint.tp_slices import full_tensor, gather_full_state_dict, shard_fn
from hetpipe.parallel.tp_shards import finalize_tensor_parallel_grads
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.training.rank_setup import build_optimizer

CPU = torch.device("cpu")
WORLD = 4  # rank = dp_rank * 2 + tp_rank
CFG = model_preset("tiny_qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                   num_query_groups=1, vocab_size=128)
LOADER_STATE = {"consumed_samples": 16}

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _build(seed, tp_group, tp_rank, dp_group):
    chunk = parallelize_tensor(build_model(CFG, seed=seed), tp_group, 2, tp_rank)
    return chunk, build_optimizer([chunk], OptimizerConfig(lr=1e-2, distributed=True), CPU, dp_group)


def _rank(rank: int, port: int, root: str, results) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=WORLD)
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp_rank, tp_rank = divmod(rank, 2)
        tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
        chunk, opt = _build(1234, tp_group, tp_rank, dp_group)
        for step in range(2):
            gen = torch.Generator().manual_seed(10 * step + dp_rank)
            tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
            chunk(tokens[:, :-1], tokens[:, 1:]).backward()
            finalize_tensor_parallel_grads(chunk)
            for p in chunk.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= 2
            opt.step()
            opt.zero_grad()
        report = {}
        for layout, save_dir, node in (("shared", f"{root}/shared", 0), ("nodes", f"{root}/node{{node}}", dp_rank)):
            saver = CheckpointSaver(CheckpointConfig(save_dir=save_dir), "unused", model_cfg=CFG, rank=rank,
                                    world_size=WORLD, store=store, node=node, node_label=f"node {node}")
            saver.save(2, [chunk], opt, LOADER_STATE)
            path = saver.wait()
            saver.close()
            # Resume from this rank's own directory under the same plan: bitwise the saved state.
            other, other_opt = _build(99, tp_group, tp_rank, dp_group)
            load_checkpoint(path, [other], other_opt, rank=rank, world_size=WORLD, shard=shard_fn([other]))
            mine, loaded = opt.sharded_state_dict(), other_opt.sharded_state_dict()
            report[layout] = {
                "path": str(path),
                "weights": all(torch.equal(a, b) for a, b in zip(chunk.state_dict().values(),
                                                                 other.state_dict().values())),
                "optimizer": mine.keys() == loaded.keys() and all(
                    torch.equal(torch.as_tensor(mine[n][k]), torch.as_tensor(loaded[n][k]))
                    for n in mine for k in ("exp_avg", "exp_avg_sq", "step", "range")),
            }
        # The whole model and its AdamW moments, for the test's single-process reads
        # (as numpy arrays: a queue passes tensors as handles that die with this process).
        params = dict(chunk.named_parameters())
        full_state = opt.full_state_dict()  # collective over DP
        report["whole"] = {k: v.numpy().copy() for k, v in gather_full_state_dict(chunk).items()}
        report["exp_avg"] = {n: full_tensor(params[n], s["exp_avg"]).numpy().copy()
                             for n, s in sorted(full_state.items())}
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", report))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = CTX.Queue()
    procs = [CTX.Process(target=_rank, args=(r, port, str(root), results), daemon=True) for r in range(WORLD)]
    return root, collect(procs, results, timeout=240)


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _pieces(manifest, name):
    files = [f["name"] for f in manifest["files"]]
    return [(files[p["file"]], p.get("index"), p.get("flat")) for p in manifest["tensors"][name]["pieces"]]


def test_each_rank_resumes_bitwise_from_its_own_directory(saved):
    _, reports = saved
    for rank, report in reports.items():
        for layout in ("shared", "nodes"):
            assert report[layout]["weights"] and report[layout]["optimizer"], (rank, layout)


def test_each_rank_writes_its_own_shards_once(saved):
    root, _ = saved
    ckpt = root / "shared" / "iter_0000002"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json", "model-rank00000.safetensors", "model-rank00001.safetensors",  # DP replicas write none
        *(f"optim-rank{r:05d}.safetensors" for r in range(WORLD)),
        *(f"rng-rank{r:05d}.safetensors" for r in range(WORLD)), "trainer_state.json"]
    manifest = _manifest(ckpt)
    # A norm (replicated over TP) once; a column-parallel weight as each TP rank's rows; the
    # one KV head, which both TP ranks hold, only in rank 0's piece of the fused q/k/v.
    assert _pieces(manifest, "layers.0.input_norm.weight") == [("model-rank00000.safetensors", None, None)]
    assert _pieces(manifest, "layers.0.mlp.down.weight") == [("model-rank00000.safetensors", [[0, 48]], None),
                                                             ("model-rank00001.safetensors", [[48, 96]], None)]
    assert _pieces(manifest, "layers.0.attention.qkv.weight") == [
        ("model-rank00000.safetensors", [[0, 32], [64, 96]], None), ("model-rank00001.safetensors", [[32, 64]], None)]
    # ZeRO-1: each rank's own flat range of its TP slice of the moments.
    moments = _pieces(manifest, "exp_avg/layers.0.mlp.down.weight")
    assert sorted(f for f, _, _ in moments) == [f"optim-rank{r:05d}.safetensors" for r in range(WORLD)]
    assert {tuple(map(tuple, index)) for _, index, _ in moments} == {((0, 48),), ((48, 96),)}
    assert manifest["world_size"] == WORLD and len(manifest["directories"]) == 1


def test_node_directories_hold_their_own_ranks_files_and_one_manifest(saved):
    root, _ = saved
    node0, node1 = root / "node0" / "iter_0000002", root / "node1" / "iter_0000002"
    for path, ranks in ((node0, (0, 1)), (node1, (2, 3))):
        assert sorted(p.name for p in path.iterdir()) == [
            "manifest.json", *(f"{kind}-rank{r:05d}.safetensors" for kind in ("model", "optim", "rng") for r in ranks),
            "trainer_state.json"]
    assert (node0 / "manifest.json").read_bytes() == (node1 / "manifest.json").read_bytes()
    manifest = _manifest(node0)
    assert [(d["committer"], d["ranks"]) for d in manifest["directories"]] == [(0, [0, 1]), (2, [2, 3])]
    # Weights are deduplicated per directory, not per job: each node holds a whole replica.
    assert [f for f, _, _ in _pieces(manifest, "layers.0.input_norm.weight")] == [
        "model-rank00000.safetensors", "model-rank00002.safetensors"]


def _whole():
    model = build_model(CFG, seed=5)
    return model, build_optimizer([model], OptimizerConfig(lr=1e-2), CPU)


def _assert_whole(model, opt, report):
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, torch.from_numpy(report["whole"][name])), name
    for name, p in model.named_parameters():
        assert torch.equal(opt.state[p]["exp_avg"], torch.from_numpy(report["exp_avg"][name])), name
        assert float(opt.state[p]["step"]) == 2.0


def test_another_plan_reads_the_whole_state_and_names_what_a_node_lacks(saved, tmp_path):
    root, reports = saved
    model, opt = _whole()
    load_checkpoint(root / "shared", [model], opt)
    _assert_whole(model, opt, reports[0])

    node0 = root / "node0" / "iter_0000002"
    other, other_opt = _whole()
    with pytest.raises(CheckpointError, match=r"optim-rank0000[23]\.safetensors is missing: rank [23] on node 1 "
                                              r"wrote it, and this directory holds only its own node's files"):
        load_checkpoint(node0, [other], other_opt)
    load_checkpoint(node0, [other])  # the weights alone are all there: each node holds a replica
    assert all(torch.equal(t, torch.from_numpy(reports[0]["whole"][n])) for n, t in other.state_dict().items())

    # What docs/checkpoints.md says to do: gather every node's iter_N into one directory.
    gathered = tmp_path / "iter_0000002"
    shutil.copytree(node0, gathered)
    for f in (root / "node1" / "iter_0000002").iterdir():
        shutil.copy(f, gathered / f.name)
    model, opt = _whole()
    load_checkpoint(gathered, [model], opt)
    _assert_whole(model, opt, reports[0])
