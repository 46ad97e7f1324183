"""One peer-bench run as every framework must see it (scripts/bench_peers.py).

The model (a hetpipe preset), sequence length, global and micro batch, GPU
count, steps, data prefix, seed, precision and the optimizer schedule: the
torchtitan TOML and the Megatron arguments are generated from one
:class:`RunSpec`, so the peers cannot drift from hetpipe's run. Importing this
imports neither peer.
"""
from __future__ import annotations

import dataclasses

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig, model_preset
from hetpipe.schema.pretrain_config import OptimizerConfig

PRECISIONS = ("bf16", "fp8")
# The optimizer schedule of the bench (as scripts/bench_pp2_llm.py's): hetpipe's
# defaults with a long warmup, as a real LLaMA-3-8B run's first steps; the learning
# rate does not change the work of a step.
LR_WARMUP_ITERS = 2000


@dataclasses.dataclass(frozen=True)
class RunSpec:
    model: str
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    gpus: int
    steps: int
    data: str
    seed: int = 1234
    precision: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("seq_length", "global_batch_size", "micro_batch_size", "gpus", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.global_batch_size % (self.micro_batch_size * self.gpus):
            raise ConfigError(f"global batch {self.global_batch_size} is not a multiple of micro batch "
                              f"{self.micro_batch_size} x {self.gpus} GPUs")
        if self.seq_length > self.model_config().max_position_embeddings:
            raise ConfigError(f"seq length {self.seq_length} exceeds model {self.model!r}'s "
                              f"max_position_embeddings={self.model_config().max_position_embeddings}")

    def model_config(self) -> ModelConfig:
        return model_preset(self.model)

    def optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(lr_warmup_iters=LR_WARMUP_ITERS)
