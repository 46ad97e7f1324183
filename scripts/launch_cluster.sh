#!/usr/bin/env bash
# Template: start a multi-node hetpipe job with one torchrun per node.
# Run this on every node of the cluster with the same MASTER_ADDR/PORT and
# HETPIPE_JOB_TOKEN, and NODE_RANK = the node's position in the cluster
# config's group order (e.g. h200_mi325x_2node: node 0 = the H200 node,
# node 1 = the MI325X node). Each node uses its own torch build (CUDA or ROCm);
# hetpipe checks it against the vendor the config declares for its ranks.
#
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 HETPIPE_JOB_TOKEN=$SECRET \
#     bash scripts/launch_cluster.sh +model=llama8b cluster=h200_mi325x_2node ...
#
# Not verified on a real multi-node mixed cluster by this project.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's address}"
: "${NODE_RANK:?set NODE_RANK to this node's index}"
: "${HETPIPE_JOB_TOKEN:?set HETPIPE_JOB_TOKEN to the same secret on every node}"
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
export HETPIPE_JOB_TOKEN
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m hetpipe.pretrain "$@"
