"""Checkpoints to and from Hugging Face transformers.

``python -m hetpipe.export`` turns a checkpoint written by a [2, 2] pipeline
into a directory that ``AutoModelForCausalLM`` loads and generates from, with
our logits; an HF directory (single file or sharded) seeds any split of a run.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli, run_pretrain
from hetpipe.checkpoint import CheckpointConfig, CheckpointError, load_hf_weights, restore, save_checkpoint
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.errors import ConfigError
from hetpipe.export import export_hf
from hetpipe.models import build_model, model_preset
from hetpipe.models.hf import to_hf_config
from hetpipe.training.rank_setup import build_optimizer

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
LLAMA = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)
QWEN2 = model_preset("tiny_qwen2", hidden_size=64, ffn_hidden_size=160)
QWEN3 = model_preset("tiny_qwen3", hidden_size=64, ffn_hidden_size=160)   # QK-norm, head size 48, tied
SPLIT = [(0, 3), (3, 6)]
TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


pytestmark = pytest.mark.usefixtures("one_thread")


def _trained_pipeline_checkpoint(save_dir, cfg):
    """A [2, 2] pipeline after two AdamW steps, saved as two ranks; returns the chunks."""
    chunks = [build_model(cfg, seed=1234, units=r) for r in SPLIT]
    optimizers = [build_optimizer([c], OptimizerConfig(lr=1e-2), CPU) for c in chunks]
    for _ in range(2):
        chunks[1](chunks[0](TOKENS), TOKENS).backward()
        if cfg.share_embeddings_and_output_weights:
            summed = chunks[0].embedding.weight.grad + chunks[1].head.output.weight.grad
            chunks[0].embedding.weight.grad.copy_(summed)
            chunks[1].head.output.weight.grad.copy_(summed)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for rank in (1, 0):
        save_checkpoint(CheckpointConfig(save_dir=str(save_dir)), "run", 2, [chunks[rank]], optimizers[rank],
                        {"consumed_samples": 0}, rank, 2, cfg, barrier=lambda: None)
    return chunks


def _our_logits(chunks):
    with torch.no_grad():
        x = TOKENS
        for chunk in chunks:
            x = chunk(x)
    return x


def test_export_cli_loads_in_transformers_with_our_logits_and_generates(tmp_path):
    chunks = _trained_pipeline_checkpoint(tmp_path / "ckpt", LLAMA)
    out = tmp_path / "hf"
    proc = run_cli(["-m", "hetpipe.export", str(tmp_path / "ckpt"), str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exported" in proc.stdout and "iter_0000002" in proc.stdout
    # save_checkpoint's trainer state records no tokenizer: the export says so in a note.
    assert "does not record its tokenizer" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["TOKENIZER_NOTE.txt", "config.json", "generation_config.json",
                                                     "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _our_logits(chunks), rtol=0, atol=1e-5)
        generated = hf.generate(TOKENS, attention_mask=torch.ones_like(TOKENS), max_new_tokens=5,
                                do_sample=False, pad_token_id=0)
    assert generated.shape == (2, TOKENS.shape[1] + 5)
    assert torch.equal(generated[:, :TOKENS.shape[1]], TOKENS)

    proc = run_cli(["-m", "hetpipe.export", str(tmp_path / "nowhere"), str(tmp_path / "x")], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"hetpipe: error: checkpoint {tmp_path / 'nowhere'} does not exist"


def test_export_tied_qwen2_in_bfloat16(tmp_path):
    chunks = _trained_pipeline_checkpoint(tmp_path / "ckpt", QWEN2)
    out, _ = export_hf(tmp_path / "ckpt" / "iter_0000002", tmp_path / "hf", dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.tie_word_embeddings
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    assert torch.equal(hf.model.embed_tokens.weight, chunks[0].embedding.weight.detach().bfloat16().float())


def test_export_qwen3_loads_in_transformers_with_our_logits(tmp_path):
    chunks = _trained_pipeline_checkpoint(tmp_path / "ckpt", QWEN3)
    out, _ = export_hf(tmp_path / "ckpt" / "iter_0000002", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 48
    # Two AdamW steps moved QK-norm's weights off 1, so they are really carried.
    assert not torch.equal(hf.model.layers[0].self_attn.q_norm.weight, torch.ones(48))
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _our_logits(chunks), rtol=0, atol=1e-5)


def _hf_dir(tmp_path, cfg, zero=(), **save_kwargs):
    """A transformers model with random, non-trivial weights saved as a HF
    directory; parameters whose names end with one of ``zero`` stay zero."""
    torch.manual_seed(0)
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # HF initialises biases to zero, which would hide a dropped one.
            if name.endswith(tuple(zero)):
                p.zero_()
            elif name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    out = tmp_path / "hf_model"
    hf.save_pretrained(out, **save_kwargs)
    return out, hf


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2, QWEN3], ids=["llama", "qwen2_tied", "qwen3_tied"])
def test_sharded_hf_directory_seeds_any_split(tmp_path, cfg):
    hf_dir, hf = _hf_dir(tmp_path, cfg, max_shard_size="200KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for split in (SPLIT, [(0, 4), (4, 6)], [(0, 6)]):
        chunks = [build_model(cfg, seed=5, units=r) for r in split]
        for chunk in chunks:
            load_hf_weights(hf_dir, [chunk], cfg)
        torch.testing.assert_close(_our_logits(chunks), expected, rtol=0, atol=1e-5)


def test_restore_seeds_from_hf_and_checks_the_config(tmp_path, capsys):
    hf_dir, hf = _hf_dir(tmp_path, LLAMA)
    model = build_model(LLAMA, seed=5)
    opt = build_optimizer([model], OptimizerConfig(), CPU)
    assert restore(CheckpointConfig(load_hf=str(hf_dir)), tmp_path, [model], opt, None, 0, 1, LLAMA) == 0
    assert "initialised weights from Hugging Face model" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, rtol=0, atol=1e-5)

    wider = model_preset("tiny_llama", hidden_size=128, ffn_hidden_size=160)
    with pytest.raises(CheckpointError, match=f"Hugging Face model {hf_dir} does not match this run's model: "
                                              "model.hidden_size=64 there but 128 here"):
        load_hf_weights(hf_dir, [build_model(wider, seed=0)], wider)
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="holds pickled PyTorch weights only; hetpipe never unpickles"):
        load_hf_weights(hf_dir, [model], LLAMA)
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_hf_weights(tmp_path, [model], LLAMA)


def test_export_refuses_a_directory_holding_other_files(tmp_path):
    _trained_pipeline_checkpoint(tmp_path / "ckpt", LLAMA)
    out = tmp_path / "hf"
    export_hf(tmp_path / "ckpt", out)
    export_hf(tmp_path / "ckpt", out)  # re-exporting over our own export is fine
    (out / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"export directory {out} already holds model-00001-of-00002"):
        export_hf(tmp_path / "ckpt", out)


# Llama with HF's attention_bias: biases on q, k, v and o_proj.
LLAMA_BIASED = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160, add_qkv_bias=True)


def _add_tensor(hf_dir, key, tensor):
    """Rewrite the directory's single safetensors file with one more tensor."""
    path = hf_dir / "model.safetensors"
    state = load_file(path)
    state[key] = tensor
    save_file(state, path, metadata={"format": "pt"})


def test_hf_round_trip_with_nonzero_biases_carries_every_tensor(tmp_path):
    """HF (non-zero q/k/v biases, zero o_proj ones) -> hetpipe -> checkpoint ->
    export -> transformers: same logits, every tensor equal, nothing missing
    or initialised by transformers."""
    for cfg, name, zero in ((LLAMA_BIASED, "llama", ("o_proj.bias",)), (QWEN2, "qwen2", ())):
        hf_dir, hf = _hf_dir(tmp_path / name, cfg, zero=zero)
        assert bool(hf.model.layers[0].self_attn.q_proj.bias.detach().any())
        chunks = [build_model(cfg, seed=5, units=r) for r in SPLIT]
        for chunk in chunks:
            load_hf_weights(hf_dir, [chunk], cfg)
        with torch.no_grad():
            expected = hf(TOKENS).logits
        torch.testing.assert_close(_our_logits(chunks), expected, rtol=0, atol=1e-5)
        optimizers = [build_optimizer([c], OptimizerConfig(), CPU) for c in chunks]
        for rank in (1, 0):
            save_checkpoint(CheckpointConfig(save_dir=str(tmp_path / name / "ckpt")), "run", 1, [chunks[rank]],
                            optimizers[rank], {"consumed_samples": 0}, rank, 2, cfg, barrier=lambda: None)
        out, _ = export_hf(tmp_path / name / "ckpt", tmp_path / name / "exported")
        back, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager", output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched key
        with torch.no_grad():
            torch.testing.assert_close(back.eval()(TOKENS).logits, expected, rtol=0, atol=1e-5)
        written, original = back.state_dict(), hf.state_dict()
        assert sorted(written) == sorted(original)
        for key, tensor in original.items():
            assert torch.equal(written[key], tensor), key


def test_hf_import_refuses_tensors_it_cannot_place(tmp_path):
    # Non-zero o_proj biases: hetpipe's output projection has none.
    hf_dir, _ = _hf_dir(tmp_path / "biased", LLAMA_BIASED)
    with pytest.raises(ConfigError, match=r"HF checkpoint has tensors hetpipe cannot place: "
                                          r"model\.layers\.0\.self_attn\.o_proj\.bias, .*o_proj biases") as info:
        load_hf_weights(hf_dir, [build_model(LLAMA_BIASED, seed=0)], LLAMA_BIASED)
    assert "\n" not in str(info.value)
    # A tensor of no known layer.
    hf_dir, _ = _hf_dir(tmp_path / "extra", LLAMA)
    _add_tensor(hf_dir, "model.layers.1.mlp.extra_proj.weight", torch.ones(4))
    with pytest.raises(ConfigError, match=r"cannot place: model\.layers\.1\.mlp\.extra_proj\.weight$"):
        load_hf_weights(hf_dir, [build_model(LLAMA, seed=0)], LLAMA)


def test_pretrain_reads_the_model_from_the_hf_directory(tmp_path):
    """`checkpoint.load_hf=DIR` alone names the model; a preset given too must agree."""
    hf_dir, _ = _hf_dir(tmp_path, LLAMA)
    args = [f"checkpoint.load_hf={hf_dir}", "train.train_iters=1", "train.seq_length=32",
            "train.micro_batch_size=2", "train.global_batch_size=2", "logging.progress=false"]
    proc, rows = run_pretrain(tmp_path / "from_hf", args)
    assert "initialised weights from Hugging Face model" in proc.stdout and len(rows) == 1
    # A preset that agrees (tiny_llama at this width) runs too; one that does
    # not stops before training, naming the first field that differs.
    run_pretrain(tmp_path / "agreeing", ["+model=tiny_llama", "model.hidden_size=64",
                                         "model.ffn_hidden_size=160", *args])
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", *args,
                    f"hydra.run.dir={tmp_path / 'differing'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"hetpipe: error: model=tiny_llama differs from checkpoint.load_hf={hf_dir}'s "
                                   "config.json: model.hidden_size=64 there but 128 here "
                                   "(drop +model to take the HF config)")


def test_pretrain_stops_in_one_line_on_a_tensor_it_cannot_place(tmp_path):
    hf_dir, _ = _hf_dir(tmp_path, LLAMA)
    _add_tensor(hf_dir, "model.layers.3.self_attn.o_proj.bias", torch.full((64,), 0.1))
    proc = run_cli(["-m", "hetpipe.pretrain", f"checkpoint.load_hf={hf_dir}", "train.train_iters=1",
                    "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2",
                    f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("hetpipe: error: HF checkpoint has tensors hetpipe cannot place: "
                                   "model.layers.3.self_attn.o_proj.bias; hetpipe's attention output projection "
                                   "has no bias, so only all-zero o_proj biases import")
    assert "initialised weights" not in proc.stdout
