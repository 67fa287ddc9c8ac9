#!/usr/bin/env bash
# What only a GPU can run, in one go (`make gpu-check`): the GPU tests; the layout matrix
# (tests/programs/layout_matrix.py) at world size 1 on NCCL, eager and compiled; then GPT-2 small (--model
# gpt2, 124M parameters, on `make gpt-data`'s BPE shards, one process, bf16) compiled in torch.compile's
# default mode at 16, 32 and 64 sequences of 1024 tokens a step and at 16 x 32 micro-batches (524,288
# tokens), and in max-autotune-no-cudagraphs at 32, 15 steps each, and harness/gpu_table.py's table of steps
# 6 to 15: ms/step, tokens/s, peak memory, MFU by two counts, each run's command, and the fastest run under
# 40 GB. PARTS="tests matrix sweep" (the default) picks the parts; the sweep alone is meant to take about 5
# minutes. Everything goes to $OUT as well. Not yet run on a GPU: the time of each run is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
DATA=${DATA:-runs/gpt-data}
PARTS=${PARTS:-tests matrix sweep}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: torch sees no CUDA GPU here: nothing to check" >&2
  exit 2
fi
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpus.txt"

# the GPU tests, every test marked gpu: the lessons on NCCL, the GPT's bf16 run, a killed GPU worker, ...
if [[ " $PARTS " == *" tests "* ]]; then
  timeout 360 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/tests.txt" || true
fi

# the layout matrix at world size 1 on NCCL (tests/gpt/test_gpt_layouts.py runs it on gloo), on its tiny model
tiny=(--n_layer 4 --n_head 4 --n_embd 32 --block_size 16 --eval_samples 8 --sample_chars 0 --grad_clip 0)
tiny+=(--lr 3e-3 --warmup_steps 0 --cache_dir "$OUT/cache")
for run in eager compile; do
  [[ " $PARTS " == *" matrix "* ]] || break
  flags=()
  if [ "$run" = compile ]; then
    flags=(--compile)
  fi
  rm -rf "${OUT:?}/matrix-$run"
  PYTHONPATH=examples/gpt timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    tests/programs/layout_matrix.py "$OUT/matrix-$run" 1 8 '{"fp32": 3, "bf16": 20, "fp16": 20}' -- \
    "${tiny[@]}" "${flags[@]}" 2>&1 | tee "$OUT/matrix-$run.txt" | grep '^COMBO' ||
    echo "gpu-check: the layout matrix ($run) failed: see $OUT/matrix-$run.txt"
done

if [[ " $PARTS " != *" sweep "* ]]; then
  exit 0
fi
if [ ! -f "$DATA/manifest.json" ]; then
  "$PY" examples/gpt/prepare.py --out "$DATA" | tail -n 3
fi
mkdir -p "$OUT/runs"
names=()
# gpt2 NAME ARGS...: GPT-2 small for 15 steps, logged every 5; its command, log and metrics under $OUT/runs
gpt2() {
  local name=$1 start=$SECONDS
  shift
  local cmd=("$PY" examples/gpt/train.py --model gpt2 --data "$DATA" --dtype bf16 --max_steps 15
    --log_every 5 --eval_every 15 --eval_samples 64 --sample_chars 0 --no_tensorboard
    --snapshot_path "$OUT/runs/$name" --metrics_path "$OUT/runs/$name.jsonl" "$@")
  rm -rf "${OUT:?}/runs/$name" "$OUT/runs/$name.jsonl"
  printf '%q ' "${cmd[@]}" >"$OUT/runs/$name.cmd"
  names+=("$name")
  timeout 300 "${cmd[@]}" >"$OUT/runs/$name.txt" 2>&1 || echo "gpu-check: $name failed: see $OUT/runs/$name.txt"
  rm -rf "${OUT:?}/runs/$name"  # its snapshot (1.5 GB)
  echo "gpu-check: $name took $((SECONDS - start)) s"
}
for batch in 16 32 64; do
  gpt2 "default-$batch" --batch_size "$batch" --compile
done
gpt2 default-16x32 --batch_size 16 --grad_accum 32 --compile
gpt2 max-autotune-32 --batch_size 32 --compile --compile_mode max-autotune-no-cudagraphs
"$PY" harness/gpu_table.py "$OUT/runs" "${names[@]}" | tee "$OUT/table.md"
echo "gpu-check: $SECONDS s in all"
