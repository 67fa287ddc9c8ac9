#!/usr/bin/env bash
# Multi-node DDP training as a Slurm batch job: one torchrun per node (started by srun), which starts the
# training processes on its node; the torchruns meet through a c10d rendezvous on the first node.
#
#   sbatch examples/slurm/sbatch_run.sh TOTAL_EPOCHS SAVE_EVERY [training options...]
#   sbatch --nodes=4 --gpus-per-node=8 --time=02:00:00 examples/slurm/sbatch_run.sh 50 10 --batch_size 64
#   SCRIPT=multigpu_accelerate.py sbatch examples/slurm/sbatch_run.sh 50 10
#   SCRIPT=gpt/train.py sbatch examples/slurm/sbatch_run.sh --max_steps 2000     # the GPT (docs/gpt.md)
#
# Submit from the repository root (or set EXAMPLES_DIR). Arguments after the script name go to the
# training script unchanged. Settings (environment at submission; sbatch passes it on):
#   SCRIPT          training script: a path under EXAMPLES_DIR (multigpu_accelerate.py, gpt/train.py)
#                   or any other path                       (default multinode.py)
#   EXAMPLES_DIR    where SCRIPT names are looked up        (default $SLURM_SUBMIT_DIR/examples)
#   NPROC_PER_NODE  training processes per node   (default: GPUs allocated on the node, else
#                   --cpus-per-task, else the CPUs allocated on the node)
#   SNAPSHOT_PATH   snapshot on a filesystem every node sees (a file for the lessons, a directory for
#                   gpt/train.py); a restarted or requeued job resumes from it
#                   (default $SLURM_SUBMIT_DIR/runs/slurm-$SLURM_JOB_ID/snapshot.pt, or .../snapshot for gpt/)
#   RDZV_HOST       rendezvous host              (default: first node of the allocation)
#   RDZV_PORT       rendezvous port on RDZV_HOST (default 20000 + job id modulo 10000, so that jobs
#                   sharing a node do not collide)
#   RDZV_TIMEOUT    seconds to wait for every node to join before the job fails (default 60); a node
#                   that cannot reach RDZV_HOST:RDZV_PORT at all gives up after about 45 s
#   MAX_RESTARTS    times torchrun restarts the training processes after a failure (default 3)
#   TORCHRUN        command that starts torchrun, split on spaces, e.g. "/opt/venv/bin/torchrun" or
#                   "python3 -m torch.distributed.run" (default: "python tools/launch.py" when submitted
#                   from the repository root, torchrun plus a message naming the endpoint and the causes
#                   when the nodes do not meet; else torchrun from PATH)
#
#SBATCH --job-name=ddp-multinode
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:30:00
# SIGTERM to the job's steps (srun passes it to torchrun, torchrun to its workers) 120 s before the time
# limit: the GPT trainer finishes its step, saves and exits (docs/slurm.md). scancel and preemption send it
# too, then SIGKILL after the cluster's KillWait (30 s unless configured).
#SBATCH --signal=TERM@120
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "$0: run this with sbatch, e.g. sbatch $0 50 10" >&2
  exit 2
fi

script=${SCRIPT:-multinode.py}
examples=${EXAMPLES_DIR:-$SLURM_SUBMIT_DIR/examples}
if [[ $script != /* && -f $examples/$script ]]; then
  script=$examples/$script
fi
[ -f "$script" ] || {
  echo "training script not found: $script (submit from the repository root or set SCRIPT/EXAMPLES_DIR)" >&2
  exit 2
}

if [ -n "${NPROC_PER_NODE:-}" ]; then
  nproc=$NPROC_PER_NODE
elif [ "${SLURM_GPUS_ON_NODE:-0}" -gt 0 ]; then
  nproc=$SLURM_GPUS_ON_NODE
elif [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  nproc=$SLURM_CPUS_PER_TASK
else
  nproc=${SLURM_CPUS_ON_NODE:-1}
fi

nnodes=$SLURM_JOB_NUM_NODES
rdzv_host=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
rdzv_port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
default_snapshot=$SLURM_SUBMIT_DIR/runs/slurm-$SLURM_JOB_ID/snapshot.pt
if [[ $script == */gpt/train.py ]]; then
  default_snapshot=${default_snapshot%.pt} # the GPT trainer's snapshot is a directory
fi
snapshot=${SNAPSHOT_PATH:-$default_snapshot}
mkdir -p "$(dirname "$snapshot")"
launch=$SLURM_SUBMIT_DIR/tools/launch.py
if [ -z "${TORCHRUN:-}" ] && [ -f "$launch" ]; then
  torchrun=(python "$launch")
else
  read -ra torchrun <<<"${TORCHRUN:-torchrun}"
fi
# After a restart (--max-restarts), the training processes of the new attempt must not find the addresses
# the previous attempt left in torchrun's rendezvous store: with the store shared (torch's default), the new
# process group reads stale ones and fails to connect ("Gloo connectFullMesh failed ... Connection refused").
# Unshared, every attempt gets a store of its own.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# After forwarding SIGTERM, torchrun waits this long for its workers to save and exit before it kills them
# (its default: 30 s); within the 120 s that --signal gives before the time limit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}
# One thread a process, torchrun's own default, set so that torchrun does not print its 4-line banner
# (raise it for processes that compute on the CPU).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# One task per node, whatever --ntasks-per-node the job was given; the step gets the job's CPUs per task
# explicitly, since srun does not take them from the job on every Slurm version.
srun_args=(--nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1)
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi

echo "job $SLURM_JOB_ID: $nnodes nodes ($SLURM_JOB_NODELIST) x $nproc processes," \
  "rendezvous $rdzv_host:$rdzv_port, snapshot $snapshot, script $script"

status=0
srun "${srun_args[@]}" "${torchrun[@]}" \
  --nnodes="$nnodes" \
  --nproc-per-node="$nproc" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$rdzv_host:$rdzv_port" \
  --rdzv-id="$SLURM_JOB_ID" \
  --rdzv-conf="join_timeout=${RDZV_TIMEOUT:-60},read_timeout=30" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  "$script" --snapshot_path "$snapshot" "$@" || status=$?

if [ "$status" -ne 0 ]; then
  echo "job $SLURM_JOB_ID: torchrun failed (exit $status); the errors above say why." \
    "RendezvousTimeoutError or RendezvousConnectionError there mean the nodes did not meet at" \
    "$rdzv_host:$rdzv_port. Usual causes: a node did not start or failed first (see its errors), the port" \
    "is blocked or taken on $rdzv_host, or $rdzv_host is not reachable from every node. Check from a node:" \
    "python tools/doctor.py --endpoint $rdzv_host:$rdzv_port" >&2
fi
exit "$status"
