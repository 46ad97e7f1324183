"""The engine's kernel warm-up leaves training exactly as if it had not run."""
import torch

from hetpipe.training.engine import PipelineEngine
from hetpipe.models import build_model
from hetpipe.models.model_config import ModelConfig
from hetpipe.pipeline.schedules import build_schedule


def _engine(cfg, chunk):
    actions = build_schedule("1f1b", 1, 2, 1)[0]
    return PipelineEngine([chunk], actions, {}, rank=0, pipeline_size=1,
                          activation_shape=(2, 16, cfg.hidden_size), activation_dtype=torch.float32,
                          device=torch.device("cpu"))


def test_warm_up_changes_no_weight_and_no_gradient(one_thread):
    cfg = ModelConfig(name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=64, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen))
             for _ in range(2)]
    plain, warmed = build_model(cfg, seed=3), build_model(cfg, seed=3)
    before = {n: p.clone() for n, p in warmed.named_parameters()}
    engine = _engine(cfg, warmed)
    engine.warm_up(batch[0])
    assert all(p.grad is None for p in warmed.parameters())
    assert all(torch.equal(before[n], p) for n, p in warmed.named_parameters())
    loss_plain = _engine(cfg, plain).run_step(batch)
    loss_warmed = engine.run_step(batch)
    assert torch.equal(loss_plain, loss_warmed)
    for (n, a), (_, b) in zip(plain.named_parameters(), warmed.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
