#!/usr/bin/env bash
# Train on several GPU nodes with SLURM: the same command runs on every host.
#
#   sbatch examples/slurm_multinode.sh
#
# One task per node, driving all of its node's GPUs. spmd.train joins the job through JAX's own
# SLURM detection (jax.distributed.initialize(): the coordinator is the first node of the step,
# the rank SLURM_PROCID, the count SLURM_NTASKS). --mesh is the GLOBAL mesh (its product = GPUs
# per node x nodes); by default the outermost data-parallel ways cross nodes and tensor stays
# inside a node. Here: 4 nodes x 8 GPUs = 32 devices, tensor parallel inside each node, fully
# sharded data parallel across the 4 nodes.
#SBATCH --job-name=spmd-1b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# JAX's SLURM detection gives each task one GPU, that of its SLURM_LOCALID (it assumes one task
# per GPU); one task per node must name all eight.
export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7

# One folder per run on the shared filesystem: config.toml, metrics.jsonl, logs/rank-*.log,
# tensorboard/ and checkpoints/ (docs/operations.md). Resubmitted or requeued, the same script
# continues from the newest complete checkpoint in it; the first time it starts fresh (--resume
# auto, the default). The folder is named here; without --run-dir it would be
# runs/1b-fsdp4-tp8-job$SLURM_JOB_ID, which a requeue (same job id) also finds again, but a
# fresh sbatch (a new id) would not.
srun python -m spmd.train \
  --model 1b \
  --mesh fsdp=4,tp=8 \
  --dcn-mesh fsdp=4 \
  --precision bf16 \
  --batch 64 --seq-len 2048 --steps 2000 \
  --data /shared/corpus \
  --run-dir /shared/runs/spmd-1b --checkpoint-every 200
