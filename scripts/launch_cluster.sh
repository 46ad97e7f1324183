#!/usr/bin/env bash
# Start hetpipe on this node: one torchrun per node, c10d rendezvous.
#
# Run it on every node with the same arguments (pretrain's overrides). The
# node's place in the job comes from hetpipe/launch/scheduler_env.py, which reads
# (auto-detected, or HETPIPE_SCHEDULER=env|slurm|k8s):
#   env    your own NODE_RANK (the node's index in the cluster config's group
#          order: for h200_mi325x_2node node 0 is the H200 node, node 1 the
#          MI325X node), RDZV_ENDPOINT=<node 0's host>:<port> (or MASTER_ADDR
#          [+ MASTER_PORT]), optional NNODES, RDZV_ID, NPROC_PER_NODE
#   slurm  a heterogeneous job, one component per vendor group
#          (scripts/slurm/hetpipe_hetjob.sbatch)
#   k8s    one pod group per vendor group (scripts/k8s/hetpipe.yaml)
# Without NODE_RANK (and outside Slurm and Kubernetes) the whole cluster runs
# on this machine, as for cpu_mixed or gpu2_mixed.
#
# The job's shared secret comes from HETPIPE_JOB_TOKEN or from the file named
# by HETPIPE_JOB_TOKEN_FILE (readable by its owner only), the same on every
# node; a multi-node job without one is refused. Each node uses its own torch
# build (CUDA or ROCm); hetpipe checks it against the vendor the cluster config
# declares for the node's ranks.
#
# Each node's NICs come from the cluster config (cluster.transport.interfaces
# or subnets, resolved on the node itself): its ranks listen on them, torchrun
# is told the first one (--local-addr), and gloo and NCCL/RCCL use the same
# interfaces - no per-node overrides or GLOO_SOCKET_IFNAME by hand.
# HETPIPE_RDZV_TIMEOUT_S (default 600) bounds how long a node waits for the
# others to join.
#
# Restarts: HETPIPE_MAX_RESTARTS (default: train.max_restarts when given on
# this command line, else 0) becomes torchrun's --max-restarts; it must equal
# train.max_restarts (a job started otherwise stops with one line saying so).
# After a rank fails, every node's ranks are restarted and resume from the
# latest checkpoint; each restart is one "hetpipe: ... restarting the job
# (restart K of N)" line per node.
#
# Preemption: SIGTERM to this script's process (it becomes the launcher) -
# what Slurm sends at preemption or time limit - is forwarded to the ranks,
# which finish their step and save a checkpoint (train.preemption_signals;
# SIGUSR1 too when listed there, for `sbatch --signal=USR1@<seconds>`); the
# node then exits 0, or 128+the signal if its ranks did not save within
# torchrun's shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s; see
# scripts/slurm/hetpipe_hetjob.sbatch).
#
#   NODE_RANK=1 RDZV_ENDPOINT=10.0.0.1:29400 HETPIPE_JOB_TOKEN_FILE=~/.hetpipe-token \
#     bash scripts/launch_cluster.sh +model=llama8b cluster=h200_mi325x_2node ...
#
# PYTHON picks the interpreter (default: python). Not run on a real
# multi-node mixed cluster or a real scheduler by this project.
set -euo pipefail
PYTHON=${PYTHON:-python}

# This node's place: HETPIPE_NNODES, HETPIPE_NODE_RANK, HETPIPE_NPROC_PER_NODE,
# HETPIPE_FIRST_RANK, HETPIPE_GROUP, HETPIPE_VENDOR, HETPIPE_RDZV_*, and on a
# multi-node job HETPIPE_LOCAL_ADDR, this node's first NIC as
# cluster.transport selects it (a bad or missing variable, or a NIC this node
# lacks, is one "hetpipe: error:" line and exit 2).
place=$("$PYTHON" -m hetpipe.launch.scheduler_env --scheduler "${HETPIPE_SCHEDULER:-auto}" -- "$@")
eval "$place"

# scheduler_env has checked that the token file is its owner's only and not empty.
if [[ -z "${HETPIPE_JOB_TOKEN:-}" && -n "${HETPIPE_JOB_TOKEN_FILE:-}" ]]; then
  HETPIPE_JOB_TOKEN=$(<"$HETPIPE_JOB_TOKEN_FILE")
elif [[ -z "${HETPIPE_JOB_TOKEN:-}" ]]; then
  # One machine only (scheduler_env refuses more nodes without a token): all
  # ranks are this torchrun's children, so a fresh secret reaches all of them.
  HETPIPE_JOB_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
fi
export HETPIPE_JOB_TOKEN

# Pre-flight check before the job, the single place for it: hetpipe.doctor
# with the job's own command line, one process per node, comparing the nodes
# through a rendezvous of its own on the next port (so the job's store never
# meets the doctor's while one node is still checking). On by default;
# HETPIPE_DOCTOR=0 skips it. A blocker stops this node with the doctor's exit
# status (through hetpipe.launch: its lines, not torchrun's traceback).
if [[ "${HETPIPE_DOCTOR:-1}" != 0 ]]; then
  if [[ "$HETPIPE_NNODES" == 1 ]]; then
    "$PYTHON" -m hetpipe.doctor "$@"
  else
    "$PYTHON" -m hetpipe.launch --nnodes "$HETPIPE_NNODES" --nproc-per-node 1 \
      --rdzv-backend c10d --rdzv-id "$HETPIPE_RDZV_ID-doctor" ${HETPIPE_LOCAL_ADDR:+--local-addr "$HETPIPE_LOCAL_ADDR"} \
      --rdzv-endpoint "${HETPIPE_RDZV_ENDPOINT%:*}:$(( ${HETPIPE_RDZV_ENDPOINT##*:} + 1 ))" \
      --rdzv-conf "is_host=$HETPIPE_RDZV_IS_HOST,read_timeout=${HETPIPE_RDZV_TIMEOUT_S:-600}" \
      -m hetpipe.doctor "$@"
  fi
fi

# torchrun's c10d rendezvous numbers nodes by sorted host address and ignores
# --node-rank, so each worker's RANK is set from the cluster config's order
# instead: HETPIPE_FIRST_RANK + LOCAL_RANK (hetpipe.launch.fork_server.node_rank; the
# node's ranks fork from one server that imported torch and hetpipe once).
# Workers reach the store as clients of torchrun's agent store, so the
# renumbering is safe. is_host is given, not
# guessed from host names; --local-addr is the address the other nodes reach
# this one at, not what its host name resolves to (loopback, often);
# read_timeout and join_timeout let the nodes start minutes apart (image
# pulls, queueing of a job component), and bound how long a node waits for one
# that never comes. hetpipe.launch is torchrun with one-line failures.
if [[ -z "${HETPIPE_MAX_RESTARTS:-}" ]]; then
  HETPIPE_MAX_RESTARTS=0
  for arg in "$@"; do
    [[ "$arg" == train.max_restarts=* ]] && HETPIPE_MAX_RESTARTS=${arg#train.max_restarts=}
  done
fi

exec "$PYTHON" -m hetpipe.launch \
  --nnodes "$HETPIPE_NNODES" --nproc-per-node "$HETPIPE_NPROC_PER_NODE" --max-restarts "$HETPIPE_MAX_RESTARTS" \
  --rdzv-backend c10d --rdzv-endpoint "$HETPIPE_RDZV_ENDPOINT" --rdzv-id "$HETPIPE_RDZV_ID" \
  ${HETPIPE_LOCAL_ADDR:+--local-addr "$HETPIPE_LOCAL_ADDR"} \
  --rdzv-conf "is_host=$HETPIPE_RDZV_IS_HOST,read_timeout=${HETPIPE_RDZV_TIMEOUT_S:-600},join_timeout=${HETPIPE_RDZV_TIMEOUT_S:-600}" \
  -m hetpipe.pretrain "$@"
