#!/usr/bin/env bash
# Run a torchrun lesson under mpirun: each process takes its place from OpenMPI's variables and the
# processes meet over env:// at MASTER_ADDR:MASTER_PORT (the first host's address), as torchrun would
# have them meet. The wheels' torch has no MPI backend: mpirun only starts the processes; gloo or NCCL
# carries the training.
#   mpirun -np 4 -H node0:2,node1:2 --bind-to none -x MASTER_ADDR=node0 -x MASTER_PORT=29500 \
#       examples/mpi/mpirun_env.sh examples/multinode.py 10 5
# --bind-to none: Open MPI pins each process to a core by default, and torch's threads with it. The node
# number assumes as many processes on every host, placed by slot (Open MPI's default, not --map-by node).
set -euo pipefail
if [ -z "${OMPI_COMM_WORLD_RANK:-}" ]; then
  echo "error: start me with mpirun (Open MPI): no OMPI_COMM_WORLD_RANK" >&2
  exit 2
fi
: "${MASTER_ADDR:?error: set MASTER_ADDR to the address of the first host (mpirun -x MASTER_ADDR=...)}"
export MASTER_PORT="${MASTER_PORT:-29500}"
export RANK="$OMPI_COMM_WORLD_RANK"
export WORLD_SIZE="$OMPI_COMM_WORLD_SIZE"
export LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK"
export LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE"
# the node's index, as torchrun's GROUP_RANK: every host runs as many processes
export GROUP_RANK=$((RANK / LOCAL_WORLD_SIZE))
exec "${PYTHON:-python3}" "$@"
