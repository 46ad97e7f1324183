#!/usr/bin/env bash
# Builds .pw/, the offline wheels of the peer bench (scripts/bench_peers.py) for the GPU image (python 3.12,
# torch 2.11.0+cu130; it reaches no index). The image already has torch, triton, numpy, pyyaml, safetensors,
# transformers, tokenizers, pyarrow, pandas, xxhash, requests, fsspec, huggingface_hub, aiohttp, tqdm, einops,
# tensorboard and pillow; these wheels are what it lacks:
#   torchtitan 0.2.2   0.3.0 needs a newer torch: its torchtitan.trainer imports DataParallelMeshDims from
#                      torch.distributed.fsdp, which torch 2.11 does not have. 0.2.2 imports and has the llama3
#                      train spec. Its requirements outside the image: torchdata, datasets (imported by the llama3
#                      spec's text loader even when another loader is registered; <4.8 for its
#                      dill/multiprocess pins; it asks fsspec<=2026.2.0 and the image has 2026.7.0, which
#                      its import does not check), tyro (+ docstring_parser, typeguard, shtab). tomli is only a
#                      fallback for python < 3.11 (tomllib), so it is not carried.
#   torchao 0.18.0     float8 training (torchtitan's `float8` converter); the release the kernel bundle carries, run on the image
#   megatron-core 0.16.1  a cp312 binary wheel (its dataset helpers compiled); requires only torch, numpy,
#                      packaging. It ships no megatron.training: scripts/peers/megatron_train.py is the loop.
#   hydra-core, omegaconf, antlr4-python3-runtime  for hetpipe itself
# Run from the project root (the network must reach PyPI); .pw/ is kept out of git through .git/info/exclude.
# Install on the GPU machine (scripts/bench_peers.py --site /tmp/pw puts it on the runs' PYTHONPATH):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pw .pw/*.whl
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.pw/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null || echo '/.pw/' >> "$(git rev-parse --git-path info/exclude)"
py=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
rm -rf .pw && mkdir -p .pw
python3 -m pip download -q --no-deps "${py[@]}" -d .pw \
  torchtitan==0.2.2 torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
  tyro==0.9.35 docstring_parser==0.17.0 typeguard==4.4.4 shtab==1.7.2 \
  torchao==0.18.0 megatron-core==0.16.1 \
  hydra-core==1.3.2 omegaconf==2.3.0
# antlr4's runtime is published as a source archive only: build its (pure-Python) wheel here.
python3 -m pip wheel -q --no-deps -w .pw antlr4-python3-runtime==4.9.3
ls -la .pw && du -sh .pw
