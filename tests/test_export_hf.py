"""``python -m hetpipe.export`` of a tiny CPU run, loaded and generated from as a
user would: the run's tokenizer beside the weights (or the byte tokenizer's
note), its bos/eos/pad ids in config.json and generation_config.json, files 0644."""
import json
import stat

import pytest
import torch

from conftest import run_cli, run_pretrain

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

TINY = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=2",
        "logging.progress=false", "cluster.groups.0.device_type=CPU"]


def _export(tmp_path, *data_args):
    """Train two steps with ``data_args``, export the checkpoint; returns (stdout, export dir)."""
    ckpt = tmp_path / "ckpt"
    run_pretrain(tmp_path / "run", [*TINY, *data_args, f"checkpoint.save_dir={ckpt}"])
    proc = run_cli(["-m", "hetpipe.export", str(ckpt), str(tmp_path / "hf")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, tmp_path / "hf"


def _ids(out, name):
    config = json.loads((out / name).read_text())
    return config.get("bos_token_id"), config.get("eos_token_id"), config.get("pad_token_id")


def _modes(out):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}


def _generate(out, prompt):
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():  # pad and eos come from generation_config.json, not from the call
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   do_sample=False)
    assert torch.equal(generated[:, :prompt.shape[1]], prompt) and generated.shape[1] > prompt.shape[1]
    return generated


def test_export_of_a_byte_tokenizer_run_names_its_end_of_document_and_says_why_no_tokenizer(tmp_path,
                                                                                             corpus_prefix):
    stdout, out = _export(tmp_path, f"data.path={corpus_prefix}")
    assert "note: the run used the byte tokenizer, which has no Hugging Face form" in stdout
    assert "256 ends a document" in (out / "TOKENIZER_NOTE.txt").read_text()
    assert _ids(out, "config.json") == (None, 256, 256)
    assert _ids(out, "generation_config.json") == (None, 256, 256)
    assert _modes(out) == dict.fromkeys(["config.json", "generation_config.json", "model.safetensors",
                                         "TOKENIZER_NOTE.txt"], 0o644)
    _generate(out, torch.tensor([list(b"def ")]))


def test_export_of_a_hf_tokenizer_run_writes_the_tokenizer_and_its_ids(tmp_path, corpus_text, hf_tokenizer_dir):
    directory, _ = hf_tokenizer_dir
    prefix = tmp_path / "bpe"
    proc = run_cli(["scripts/preprocess_data.py", "--input", str(corpus_text), "--tokenizer", str(directory),
                    "--text-sample-by", "paragraph", "--output-prefix", str(prefix)])
    assert proc.returncode == 0, proc.stderr
    stdout, out = _export(tmp_path, "data=megatron", f"data.path={prefix}_text_document",
                          f"data.tokenizer={directory}")
    assert f"tokenizer {directory} written beside the weights" in stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == eos
    # The tokenizer has no bos and no pad token: padding falls back to its end of document.
    assert _ids(out, "config.json") == (None, eos, eos) == _ids(out, "generation_config.json")
    assert set(_modes(out).values()) == {0o644} and "tokenizer.json" in _modes(out)
    prompt = tokenizer("The module", return_tensors="pt").input_ids
    text = tokenizer.decode(_generate(out, prompt)[0])
    assert text.startswith("The module")
