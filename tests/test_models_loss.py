"""The chunked fused output-projection + cross-entropy against the plain formula."""
import pytest
import torch
import torch.nn.functional as F

from hetpipe.models import ModelConfig, build_model
from hetpipe.models.loss import FUSED_CHUNK_BYTES, auto_chunk_tokens, fused_linear_cross_entropy


def _close(got, ref, rel=1e-6):
    """Relative to the tensor's scale: elementwise within rel * max|ref| (a
    gradient entry near zero is a sum that cancels, so its own relative error
    means nothing), and normwise within rel."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * scale)
    assert (got - ref).norm().item() <= rel * ref.norm().item() + 1e-30


def _inputs(n=37, h=24, v=97, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=gen, dtype=dtype) * 0.3).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, labels


def _reference(hidden, weight, labels, **kwargs):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(h, w).float(), labels, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _ours(hidden, weight, labels, scale=1.0, **kwargs):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, labels, **kwargs)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [None, 1, 5, 8, 36, 37, 100])
def test_matches_cross_entropy_fp32(chunk):
    hidden, weight, labels = _inputs()
    ref = _reference(hidden, weight, labels)
    got = _ours(hidden, weight, labels, chunk_tokens=chunk)
    for r, g in zip(ref, got):
        _close(g, r)


@pytest.mark.parametrize("chunk", [3, 16])
def test_ignore_index_is_mean_over_the_rest(chunk):
    hidden, weight, labels = _inputs()
    labels = labels.clone()
    labels[::3] = -100
    ref = _reference(hidden, weight, labels)
    got = _ours(hidden, weight, labels, chunk_tokens=chunk)
    for r, g in zip(ref, got):
        _close(g, r)


def test_backward_scales_by_grad_output():
    hidden, weight, labels = _inputs()
    _, gh, gw = _ours(hidden, weight, labels, chunk_tokens=7)
    _, gh3, gw3 = _ours(hidden, weight, labels, scale=0.25, chunk_tokens=7)
    torch.testing.assert_close(gh3, gh * 0.25, rtol=1e-6, atol=0)
    torch.testing.assert_close(gw3, gw * 0.25, rtol=1e-6, atol=0)


def test_second_backward_refuses():
    hidden, weight, labels = _inputs()
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already consumed"):
        loss.backward()


def test_no_grad_and_frozen_weight():
    hidden, weight, labels = _inputs()
    ref, ref_gh, _ = _reference(hidden, weight, labels)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    assert not loss.requires_grad
    _close(loss, ref)
    h = hidden.detach().clone().requires_grad_(True)
    fused_linear_cross_entropy(h, weight.detach(), labels, chunk_tokens=8).backward()
    _close(h.grad, ref_gh)


def test_bf16_autocast_on_cpu_through_the_head():
    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=300,
                      max_position_embeddings=64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))

    def run(fused: bool):
        model = build_model(cfg, seed=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss = model(tokens, labels)
            else:  # the pre-fusion head: autocast's bf16 linear, then fp32 CE
                x = model.embedding(tokens)
                from hetpipe.models.layers import rope_cos_sin
                cos, sin = rope_cos_sin(model.inv_freq, x.shape[1], x.dtype)
                for layer in model.layers.values():
                    x = layer(x, cos, sin)
                loss = F.cross_entropy(model.head.logits(x).float().flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = run(True)
    ref_loss, ref_grads = run(False)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], ref, rtol=5e-2, atol=2e-3, msg=name)


def test_bf16_compute_dtype_with_fp32_inputs():
    hidden, weight, labels = _inputs(n=64, h=32, v=200)
    ref = _reference(hidden, weight, labels)
    got = _ours(hidden, weight, labels, chunk_tokens=10, compute_dtype=torch.bfloat16)
    for r, g in zip(ref, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=3e-2, atol=3e-3)


def test_auto_chunk_size():
    # 256 MiB of fp32 logits allow 523 tokens: 16 equal chunks of 512.
    assert auto_chunk_tokens(8192, 128256) == 512
    # Two chunks of 500 tokens, rounded up to the 128-token GEMM tile.
    assert auto_chunk_tokens(1000, 128256) == 512
    # The fused path's 2 GiB of bf16 logits and gradients: two chunks at seq 8192, one at 4096.
    assert auto_chunk_tokens(8192, 128256, FUSED_CHUNK_BYTES, 4) == 4096
    assert auto_chunk_tokens(4096, 128256, FUSED_CHUNK_BYTES, 4) == 4096
    assert auto_chunk_tokens(4096, 512) == 4096            # a tiny model: one chunk
    assert auto_chunk_tokens(100, 10**9) == 1              # small chunks stay unrounded
    assert auto_chunk_tokens(10, 10**12) == 1


def test_no_tokens_gives_zero_weight_grad():
    """The weight-gradient buffer is written by the first chunk's GEMM; with no
    chunk at all it must still be zeros, not uninitialised memory."""
    hidden, weight, labels = _inputs(n=0)
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    assert torch.isnan(loss)                               # like F.cross_entropy on nothing
    loss.backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_model_loss_matches_plain_head_fp32():
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=300,
                      max_position_embeddings=64)
    model = build_model(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    loss = model(tokens, labels)
    logits = model(tokens)
    ref = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_weight_grad_accumulates_in_fp32():
    from hetpipe.models.loss import _accumulate_fp32

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 48, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(48, 32, device="cuda", generator=gen).to(torch.bfloat16)
    acc = torch.randn(64, 32, device="cuda", generator=gen)
    expected = acc + a.float() @ b.float()
    _accumulate_fp32(acc, a.t().contiguous().t(), b)  # a transposed view, as the head passes it
    torch.testing.assert_close(acc, expected, rtol=1e-2, atol=1e-2)
    hidden, weight, labels = (t.cuda() for t in _inputs(n=300, h=64, v=1000))
    ref = _reference(hidden, weight, labels)
    got = _ours(hidden, weight, labels, chunk_tokens=64, compute_dtype=torch.bfloat16)
    for r, g in zip(ref, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=3e-2, atol=3e-3)


@pytest.mark.parametrize("chunk", [8, 37])
def test_fused_chunk_math_matches_the_plain_formula(chunk):
    """fused=True: each chunk's loss and logit gradient from one compiled
    function (uneven last chunk, ignored labels, fp32 and bf16 GEMMs)."""
    hidden, weight, labels = _inputs()
    labels = labels.clone()
    labels[::4] = -100
    ref = _reference(hidden, weight, labels)
    for r, g in zip(ref, _ours(hidden, weight, labels, chunk_tokens=chunk, fused=True)):
        _close(g, r, rel=1e-5)
    eager_bf16 = _ours(hidden, weight, labels, chunk_tokens=chunk, compute_dtype=torch.bfloat16)
    fused_bf16 = _ours(hidden, weight, labels, chunk_tokens=chunk, compute_dtype=torch.bfloat16, fused=True)
    for e, f in zip(eager_bf16, fused_bf16):
        assert f.dtype == e.dtype == torch.float32
        torch.testing.assert_close(f, e, rtol=1e-2, atol=1e-3)
    # Without gradients the eager path runs (nothing to fuse but the loss).
    with torch.no_grad():
        _close(fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, fused=True), ref[0])
