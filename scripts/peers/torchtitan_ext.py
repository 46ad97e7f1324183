"""torchtitan's extension for the peer bench, imported by torchtitan itself
(``[experimental] custom_import = "torchtitan_ext"`` in the generated TOML).

It registers, through torchtitan's own ``register_train_spec``, the train spec
``hetpipe_llama3``: torchtitan's llama3 model, parallelize and pipelining
functions, optimizer, scheduler and loss, with

* one flavor per hetpipe LLaMA preset (torchtitan_config.flavor_args: the
  same dim, layers, heads, KV heads, vocabulary, SwiGLU width, norm eps and
  RoPE theta as ``+model=NAME``), and
* a dataset of the Megatron .bin/.idx (``training.dataset_path`` is its
  prefix) that gives each DP rank the samples hetpipe's sampler gives it,
  in hetpipe's order: the same data, step for step.

Runs on the GPU machine only (it imports torchtitan); nothing here is imported on CPU.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models import llama3
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec

from hetpipe.data import GlobalBatchSampler, IndexedDataset, PackedSequenceDataset
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import model_preset, preset_names

from torchtitan_config import DATASET, SPEC_NAME, flavor_args, rope_scaling


class IndexedSamples(IterableDataset):
    """This DP rank's samples of the global batches, one ``({"input": x}, labels)`` at a time."""

    def __init__(self, prefix: str, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        self.samples = PackedSequenceDataset(IndexedDataset(prefix), seq_len)
        # One sample per micro batch of the sampler: the loader batches them as torchtitan asks.
        self.sampler = GlobalBatchSampler(len(self.samples), global_batch, 1, dp_rank, dp_size, seed)

    def __iter__(self):
        while True:
            for micro in self.sampler.next_step():
                tokens = torch.from_numpy(self.samples[int(micro[0])])
                yield {"input": tokens[:-1]}, tokens[1:]


def build_indexed_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    training = job_config.training
    if training.dataset != DATASET:
        raise ConfigError(f"the {SPEC_NAME} spec reads dataset {DATASET!r}, not {training.dataset!r}")
    data = IndexedSamples(training.dataset_path, training.seq_len, training.global_batch_size, dp_rank,
                          dp_world_size, job_config.debug.seed or 1234)
    return ParallelAwareDataloader(data, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=training.local_batch_size)


def flavors() -> dict[str, TransformerModelArgs]:
    out = {}
    for name in preset_names():
        try:
            cfg = model_preset(name)
            args = flavor_args(cfg)
        except ConfigError:
            continue  # not a model torchtitan's llama3 can express
        out[name] = TransformerModelArgs(**args, rope_scaling_args=RoPEScalingArgs(**rope_scaling(cfg)))
    return out


def _register() -> None:
    spec = llama3.get_train_spec()
    register_train_spec(SPEC_NAME, dataclasses.replace(
        spec, model_args=flavors(), build_dataloader_fn=build_indexed_dataloader, build_tokenizer_fn=None))


_register()
