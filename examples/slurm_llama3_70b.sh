#!/bin/bash
# Llama-3 70B pretraining on 8 nodes x 8 GPUs: dp 8 (FSDP across nodes) x tp 8 (inside a node).
#
#   sbatch examples/slurm_llama3_70b.sh
#
# One torchrun per node (srun --ntasks-per-node=1); torchrun starts 8 workers per node and
# rendezvous over c10d at the first node. --max-restarts lets a job survive a lost rank:
# every worker restarts and fsdp2d resumes from the latest checkpoint by itself.
#SBATCH --job-name=fsdp2d-llama3-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8

srun torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node 8 \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_node:29500" \
  --max-restarts 3 \
  -m fsdp2d.train --config configs/llama3_70b_64gpu.toml \
  --data.path=/data/tokens --metrics.run_name="llama3-70b-$SLURM_JOB_ID" "$@"
