"""The peer bench (scripts/bench_peers.py) on CPU: its refusals, the peers'
generated configs against hetpipe's model, one FLOPs formula for all, and a
failing peer kept in the table with its error. The peers themselves need GPUs;
nothing here imports torchtitan or megatron."""
import json
import sys
import tomllib

import pytest

from conftest import REPO, run_cli
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.model_config import model_preset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "peers"))
    import bench_peers

    return bench_peers


def _refusal(bench, argv, capfd) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetpipe: error: "), err
    return err


def test_bad_arguments_are_one_line_and_status_2(bench, tmp_path, corpus_prefix, capfd):
    base = ["--out", str(tmp_path), "--data", corpus_prefix]
    assert "--gpus" in _refusal(bench, [*base, "--gpus", "3"], capfd)
    assert "unknown --runs ['deepspeed']" in _refusal(bench, [*base, "--runs", "hetpipe,deepspeed"], capfd)
    assert "--warmup 5" in _refusal(bench, [*base, "--steps", "5", "--warmup", "5"], capfd)
    assert "not a multiple" in _refusal(bench, [*base, "--global-batch", "3"], capfd)
    assert "max_position_embeddings" in _refusal(bench, [*base, "--seq-length", "9000"], capfd)
    assert "unknown model 'llama9b'" in _refusal(bench, [*base, "--model", "llama9b"], capfd)
    assert "does not exist" in _refusal(bench, ["--out", str(tmp_path), "--data", str(tmp_path / "none")], capfd)


@pytest.mark.parametrize("gpus,layout", [(2, "fsdp"), (4, "pp_interleaved"), (2, "pp_zbv")])
def test_torchtitan_toml_is_hetpipe_model_and_batch(bench, gpus, layout):
    import torchtitan_config

    spec = bench.RunSpec("llama8b", 4096, 32, 1, gpus, 5, "/d/x")
    job = tomllib.loads(torchtitan_config.render(spec, layout, "/o"))
    cfg = model_preset("llama8b")
    args = torchtitan_config.flavor_args(cfg)
    # torchtitan's SwiGLU width from the flavor (its formula), and every shape field hetpipe's.
    width = int(2 * 4 * args["dim"] / 3)
    width = args["multiple_of"] * -(-width // args["multiple_of"])
    assert (width, args["dim"], args["n_layers"], args["n_heads"], args["n_kv_heads"], args["vocab_size"],
            args["norm_eps"], args["rope_theta"]) == (14336, 4096, 32, 32, 8, 128256, 1e-5, 500000.0)
    assert torchtitan_config.rope_scaling(cfg) == {"scaling_factor": 1.0}  # LLaMA-3: no 3.1 scaling
    assert job["model"] == {"name": "hetpipe_llama3", "flavor": "llama8b"}
    train, par = job["training"], job["parallelism"]
    assert (train["seq_len"], train["global_batch_size"], train["dataset_path"]) == (4096, 32, "/d/x")
    assert train["mixed_precision_param"] == "bfloat16" and train["mixed_precision_reduce"] == "float32"
    assert job["experimental"]["custom_import"] == "torchtitan_ext" and job["job"]["dump_folder"] == "/o"
    if layout == "fsdp":
        assert (par["data_parallel_shard_degree"], train["local_batch_size"], job["compile"]["enable"]) == (gpus, 1, True)
    else:
        assert par["pipeline_parallel_degree"] == gpus and train["local_batch_size"] == 32
        assert par["pipeline_parallel_schedule"] == {"pp_interleaved": "Interleaved1F1B",
                                                      "pp_zbv": "ZBVZeroBubble"}[layout]


def test_megatron_args_are_hetpipe_model_and_batch(bench):
    import megatron_config

    spec = bench.RunSpec("llama8b", 8192, 64, 2, 4, 5, "/d/x")
    argv = megatron_config.parse(megatron_config.render(spec, "pp"))
    value = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if not argv[i + 1].startswith("--")}
    cfg = model_preset("llama8b")
    assert (int(value["--num-layers"]), int(value["--hidden-size"]), int(value["--ffn-hidden-size"]),
            int(value["--num-query-groups"]), int(value["--vocab-size"]), float(value["--rotary-base"]),
            float(value["--norm-epsilon"])) == (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size,
                                                cfg.num_query_groups, cfg.vocab_size, cfg.rotary_base, cfg.norm_epsilon)
    assert (value["--seq-length"], value["--global-batch-size"], value["--micro-batch-size"]) == ("8192", "64", "2")
    assert value["--pipeline-model-parallel-size"] == "4" and value["--data-path"] == "/d/x"
    assert {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16",
            "--swiglu", "--untie-embeddings-and-output-weights"} <= set(argv)


def test_committed_examples_are_the_generators_output(bench):
    import megatron_config
    import torchtitan_config

    spec = bench.RunSpec("llama8b", 8192, 32, 1, 2, 5, "DATA_PREFIX")
    peers = REPO / "scripts" / "peers"
    assert (peers / "torchtitan_llama8b.toml").read_text() == torchtitan_config.render(spec)
    assert (peers / "megatron_llama8b.args").read_text() == megatron_config.render(spec)


def test_one_flops_formula_for_every_run(bench):
    spec = bench.RunSpec("llama8b", 8192, 32, 1, 2, 5, "/d/x")
    # 32 sequences of 8192 in 10 s on 2 GPUs: hetpipe's step FLOPs / time / GPUs.
    expected = megatron_model_flops(model_preset("llama8b"), 32, 8192) / 10 / 2 / 1e12
    assert bench.tflops_per_gpu(spec, 32 * 8192 / 10) == pytest.approx(expected, rel=1e-12)


# Stands in for torchrun: the torchtitan run prints two ranks' metrics lines and
# exits 0; the Megatron run prints a traceback's last line and exits 1.
FAKE_TORCHRUN = r"""
import sys
if "torchtitan.train" in sys.argv:
    for step in (1, 2, 3):
        for rank, mem in ((0, 50.5), (1, 61.25)):
            print(f"[rank{rank}]:[titan] step: {step}  loss: {12 - step:.4f}  grad_norm:  1.0  "
                  f"memory: {mem:.2f}GiB(40.0%)  tps: {1000 * step:,}  tflops: 1.0  mfu: 1.0%")
    sys.exit(0)
print("RuntimeError: megatron exploded on purpose", file=sys.stderr)
sys.exit(1)
"""


def test_a_failing_peer_is_in_the_table_with_its_error(tmp_path, corpus_prefix):
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    out = tmp_path / "bench"
    proc = run_cli(["scripts/bench_peers.py", "--out", str(out), "--data", corpus_prefix,
                    "--runs", "torchtitan,megatron", "--steps", "3", "--warmup", "1",
                    "--launcher", f"{sys.executable} {fake}"], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())["results"]
    titan, megatron = results["torchtitan"], results["megatron"]
    # torchtitan's tps is per GPU: steps 2 and 3 (after the warmup) at 2000 and 3000 x 2 GPUs.
    assert titan["tokens_per_s"] == 5000 and titan["peak_mem_gib"] == [50.5, 61.25] and titan["loss"] == 9.0
    assert megatron["failed"] == "exit 1" and "megatron exploded on purpose" in megatron["error"]
    table = (out / "results.md").read_text()
    assert "| megatron | exit 1: RuntimeError: megatron exploded on purpose |" in table
    assert "hetpipe / best peer: -" in table
    assert (out / "torchtitan" / "job.toml").is_file() and (out / "megatron" / "megatron.args").is_file()
