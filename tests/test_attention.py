"""Attention by device (train.attention_backend, models/attention.py) and
document masking (data.reset_attention_mask / reset_position_ids,
models/documents.py) on CPU.

FlashAttention-4 cannot run here, so its two entry points are replaced by a
reference with their signatures and return values ((out, lse), q [b, s, hq, d]
or [total, hq, d] with cu_seqlens) that computes attention in plain ops,
mapping query head i to KV head i // (hq / hkv) itself: the FA4 path's
layouts, GQA and varlen boundaries are what makes its losses equal SDPA's.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli, run_pretrain
from hetpipe.errors import ConfigError
from hetpipe.models import attention, build_model, model_preset
from hetpipe.models.attention import DeviceFacts, Fa4Kernel, SdpaKernel, choose_kernel
from hetpipe.models.documents import DocumentRule
from hetpipe.models.layers import use_attention_kernel
from hetpipe.models.recompute import set_recompute
from hetpipe.models.transformer import set_document_masking

H200 = DeviceFacts("NVIDIA H200", (9, 0))
B200 = DeviceFacts("NVIDIA B200", (10, 0))
A100 = DeviceFacts("NVIDIA A100-SXM4-80GB", (8, 0))
MI300X = DeviceFacts("AMD Instinct MI300X", None)  # ROCm: no CUDA capability
CPU = DeviceFacts("cpu", None)
EOD = 256


def test_auto_takes_fa4_on_sm90_and_sm100_where_installed_else_sdpa():
    for device in (H200, B200):
        assert choose_kernel("auto", False, device, installed=True) == Fa4Kernel(deterministic=False)
    for device, installed in ((H200, False), (A100, True), (MI300X, True), (CPU, True)):
        assert choose_kernel("auto", False, device, installed) == SdpaKernel(None)
    assert choose_kernel("auto", False, H200, True, half=False) == SdpaKernel(None)  # FA4 takes no fp32
    assert choose_kernel("cudnn", False, H200, True).backends[0].name == "CUDNN_ATTENTION"


def test_deterministic_runs_fa4_deterministic_where_it_runs_else_sdpa_flash():
    assert choose_kernel("auto", True, H200, installed=True) == Fa4Kernel(deterministic=True)
    assert choose_kernel("fa4", True, B200, installed=True) == Fa4Kernel(deterministic=True)
    for device, installed in ((H200, False), (A100, True), (CPU, True)):
        kernel = choose_kernel("auto", True, device, installed)
        assert isinstance(kernel, SdpaKernel) and kernel.backends[0].name == "FLASH_ATTENTION"


@pytest.mark.parametrize("device, installed, message", [
    (A100, True, r"rank 3's device \(NVIDIA A100-SXM4-80GB\) is not an SM90 or SM100"),
    (MI300X, True, r"rank 3's device \(AMD Instinct MI300X\) is not an SM90 or SM100"),
    (H200, False, r"not installed for rank 3 \(NVIDIA H200\): pip install --pre flash-attn-4==4.0.0b36 "
                  r"\(or the hetpipe\[kernels\] extra\)"),
])
def test_explicit_fa4_where_it_cannot_run_is_one_config_error(device, installed, message):
    with pytest.raises(ConfigError, match=message):
        choose_kernel("fa4", False, device, installed, rank=3)


def test_explicit_fa4_on_a_cpu_stops_before_step_one(tmp_path, corpus_prefix):
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=tiny_llama", f"data.path={corpus_prefix}",
                    "train.attention_backend=fa4", "train.train_iters=1", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("hetpipe: error:")]
    assert lines == ["hetpipe: error: train.attention_backend=fa4: rank 0's device (cpu) is not an SM90 or SM100 "
                     "NVIDIA GPU, which FlashAttention-4 needs; train.attention_backend=auto runs SDPA's best there"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


def _reference_attention(q, k, v, scale):
    """Causal attention of one sequence, q [s, hq, d], k/v [s, hkv, d], in plain ops."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    seq = q.shape[0]
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v), torch.logsumexp(scores, dim=-1)


class ReferenceFa4:
    """flash_attn.cute's flash_attn_func / flash_attn_varlen_func, in plain ops; records its calls."""

    def __init__(self):
        self.calls = []

    def dense(self, q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
              window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
              deterministic=False, **rest):
        assert q.dim() == 4 and causal and not rest
        self.calls.append(("dense", q.shape, k.shape, deterministic))
        outs = [_reference_attention(q[b], k[b], v[b], softmax_scale) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])

    def varlen(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None,
               page_table=None, softmax_scale=None, causal=False, deterministic=False, **rest):
        assert q.dim() == 3 and causal and torch.equal(cu_seqlens_q, cu_seqlens_k) and not rest
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q[-1] == q.shape[0]
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max_seqlen_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        self.calls.append(("varlen", q.shape, k.shape, deterministic))
        outs = [_reference_attention(q[a:b], k[a:b], v[a:b], softmax_scale)[0] for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs), None


@pytest.fixture
def fa4(monkeypatch):
    reference = ReferenceFa4()
    monkeypatch.setattr(attention, "fa4_functions", lambda: (reference.dense, reference.varlen))
    return reference


def _packed_batch(cfg, seed=0):
    """Two rows of random documents, each ended by EOD, packed end to end."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (2, 40), generator=gen)
    for row, ends in ((0, (9, 25)), (1, (17,))):
        tokens[row, list(ends)] = EOD
    return tokens


def _loss_and_grads(cfg, tokens, kernel, rule=None, recompute="none"):
    model = build_model(cfg, seed=5)
    use_attention_kernel(model, kernel)
    set_document_masking(model, rule)
    set_recompute(model, recompute)
    loss = model(tokens, tokens.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("rule, recompute", [(None, "none"), (DocumentRule(EOD, True, True), "none"),
                                             (DocumentRule(EOD, True, False), "selective"),
                                             (DocumentRule(EOD, True, True), "full")])
def test_fa4_path_trains_like_sdpa_with_gqa_documents_and_recompute(one_thread, fa4, rule, recompute):
    cfg = model_preset("tiny_llama")  # 4 query heads on 2 KV heads
    tokens = _packed_batch(cfg)
    ref_loss, ref_grads = _loss_and_grads(cfg, tokens, SdpaKernel(), rule, recompute)
    loss, grads = _loss_and_grads(cfg, tokens, Fa4Kernel(deterministic=True), rule, recompute)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    kind = "dense" if rule is None else "varlen"
    q_heads, kv_heads = cfg.num_attention_heads, cfg.num_query_groups
    assert fa4.calls and all(c[0] == kind and c[1][-2] == q_heads and c[2][-2] == kv_heads and c[3]
                             for c in fa4.calls)  # K/V not repeated; deterministic passed


def _per_token_losses(model, tokens, split=None):
    """Each position's next-token loss; ``split``: run as two chunks, the second
    given only the hidden states and the microbatch's tokens (a later stage)."""
    if split is None:
        logits = model(tokens)
    else:
        first, second = split
        logits = second(first(tokens, tokens=tokens), tokens=tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(
        tokens.shape[0], -1)


@pytest.mark.parametrize("kernel", ["sdpa", "fa4"])
@pytest.mark.parametrize("stages", [1, 2])
def test_each_packed_document_has_the_losses_it_has_alone(one_thread, fa4, kernel, stages):
    cfg = model_preset("tiny_llama")
    rule = DocumentRule(EOD, reset_attention_mask=True, reset_position_ids=True)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.cat((torch.randint(0, EOD, (n,), generator=gen), torch.tensor([EOD]))) for n in (11, 20)]
    packed = torch.cat(docs).unsqueeze(0)
    chunk = Fa4Kernel() if kernel == "fa4" else SdpaKernel()
    layers = cfg.num_layers
    models = [build_model(cfg, seed=5, units=units) for units in ([(0, layers + 2)] if stages == 1
                                                                   else [(0, 3), (3, layers + 2)])]
    for model in models:
        use_attention_kernel(model, chunk)
        set_document_masking(model, rule)
    with torch.no_grad():
        run = (lambda t: _per_token_losses(models[0], t)) if stages == 1 else \
            (lambda t: _per_token_losses(None, t, models))
        together = run(packed)[0]
        alone = torch.cat([run(doc.unsqueeze(0))[0] for doc in docs])
    # The packed row's prediction across the boundary (first EOD -> next document) has no alone counterpart.
    boundary = len(docs[0]) - 1
    keep = torch.ones_like(together, dtype=torch.bool)
    keep[boundary] = False
    torch.testing.assert_close(together[keep], alone, rtol=0, atol=1e-6)
    unmasked = build_model(cfg, seed=5)
    with torch.no_grad():
        plain = _per_token_losses(unmasked, packed)[0]
    assert (plain[boundary + 1:] - together[boundary + 1:]).abs().max() > 1e-3  # masking changes the second's


STEPS = 3
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=64",
          "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1",
          f"train.train_iters={STEPS}", "optimizer.lr=3e-3", "logging.progress=false",
          "cluster.groups.0.device_type=CPU"]
MASKING = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


@pytest.mark.timeout(400)
def test_document_masking_through_a_tp2_pipeline_across_vendor_groups(tmp_path, corpus_prefix):
    """The later stage reads the same documents from the microbatch's tokens:
    PP2 (TP2 on the first group) over the tcp channel trains like one process."""
    def train(name, *overrides):
        return [r["loss"] for r in run_pretrain(tmp_path / name, [*COMMON, f"data.path={corpus_prefix}",
                                                                  *overrides], timeout=300)[1]]

    plain = train("plain")
    single = train("single", *MASKING)
    pipelined = train("pp2_tp2", *MASKING, "cluster=cpu_mixed", "cluster.groups.0.ranks_per_node=2",
                      "partition.tp_per_group=[2,1]", "partition.layers=[1,3]")
    assert len(single) == STEPS and pipelined == pytest.approx(single, rel=1e-5)
    assert abs(single[0] - plain[0]) > 1e-4  # the corpus's samples hold document ends


def test_bench_attention_prints_every_row_and_skips_what_this_machine_lacks():
    """scripts/bench_attention.py (the lead's one GPU call) on a CPU with a tiny model."""
    proc = run_cli(["scripts/bench_attention.py", "--device", "cpu", "--model", "tiny_llama", "--seqs", "32",
                    "--iters", "1", "--warmup", "1"], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    kernels = ["cudnn", "fa4", "flash_det", "fa4_det", "fa4_docs"]
    cells = [r.strip("| ").split(" | ") for r in rows]
    assert [c[2] for c in cells[:5]] == kernels and float(cells[0][3]) > 0
    assert "FA4 not installed" in rows[1] and len(rows) == 5 + 6
