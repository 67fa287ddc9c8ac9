# One target per step of the tutorial. Every target creates the Python environment first if it is missing.
# Override on the command line:  make multigpu EPOCHS=20 NPROC=4 ARGS="--batch_size 64" VISION=1

EPOCHS ?= 10
SAVE_EVERY ?= 5
ARGS ?=
# VISION=1: the step on ResNet-18 and synthetic images (examples/vision.py), the work a GPU notices
VISION ?=
# GPUs: those CUDA_VISIBLE_DEVICES names where it is set (set and empty: none, the CPU; the tests hide the
# GPUs so), else the ones nvidia-smi lists; GPUS=0 on the command line also means the CPU.
# Processes per node: one per GPU, or 2 on a machine without GPUs.
comma := ,
ifeq ($(origin GPUS),undefined)
ifeq ($(origin CUDA_VISIBLE_DEVICES),undefined)
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
else
GPUS := $(words $(subst $(comma), ,$(CUDA_VISIBLE_DEVICES)))
endif
endif
NPROC ?= $(if $(filter-out 0,$(GPUS)),$(GPUS),2)
# multinode's rendezvous port on localhost (default: a free one)
RDZV_PORT ?=
# For `make doctor`: a rendezvous HOST:PORT to try to reach.
ENDPOINT ?=
# Where snapshots and logs go, one folder per target.
RUNS ?= runs
# The local Python environment (uv into a virtual environment, pinned by pins/dev.txt).
VENV ?= .venv
PYTHON3 ?= python3

# A variable given on the command line that no line here reads or sets (EPOCHS misspelt) stops make before
# any work, where make would ignore it: NAMED holds those read ($(X), $${X}, origin X) or set (X ?= ...).
NAMED := $(shell grep -ohE '[$$][^A-Za-z0-9 ]?[A-Z][A-Z0-9_]+|^[A-Z][A-Z0-9_]+ *[:?+]?=|(origin|ifn?def) [A-Z][A-Z0-9_]+' \
  $(MAKEFILE_LIST) | grep -oE '[A-Z][A-Z0-9_]+$$|^[A-Z][A-Z0-9_]+')
GIVEN := $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))
ifneq ($(filter-out $(NAMED),$(GIVEN)),)
$(error $(filter-out $(NAMED),$(GIVEN)): no target reads it (a typo?); make help lists the variables)
endif

PY := $(VENV)/bin/python
# one thread a process unless set: torchrun's own default, said here so that its 4-line banner does not print
TORCHRUN := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m torch.distributed.run
ENV := $(VENV)/.installed
SNAPSHOT = snapshot.pt
TRAIN_ARGS = $(EPOCHS) $(SAVE_EVERY) --snapshot_path $(RUNS)/$@/$(SNAPSHOT) $(ARGS)
# $(call step,EXAMPLE): start a step as harness/steps.py builds it (the tests and the bench use it too);
# not echoed: steps.py prints the command it runs, the one to copy
step = @mkdir -p $(RUNS)/$@ && $(PYTHON3) harness/steps.py $(1) --nproc $(NPROC) --gpus $(GPUS) \
  $(if $(RDZV_PORT),--port $(RDZV_PORT)) $(if $(VISION),--vision) --python '$(PY)' -- $(TRAIN_ARGS)
STEPS := single_gpu multigpu multigpu_torchrun multinode
# $(call retry,COMMAND): up to three tries, for downloads through a flaky network.
retry = ok=; for try in 1 2 3; do if $(1); then ok=1; break; fi; sleep 5; done; test -n "$$ok"

SHELL := bash
.SHELLFLAGS := -o pipefail -c
.DEFAULT_GOAL := help
.PHONY: bench bench-anchors bench-allreduce
.PHONY: help env single_gpu multigpu dataparallel torchrun multinode accelerate ray recipe recipe-accelerate diff doctor fault-demo torchft pitfalls gpu-check test test-quick test-fast lint k8s-check pins clean distclean

# ==== Docker and two nodes: the image (Dockerfile) and two containers as two nodes (compose.yaml, compose/) ===
# make image [BASE_IMAGE=...]          build $(IMAGE); without a registry: make base-image first, then
#                                      make image BASE_IMAGE=local/ddp-base:bookworm
# make image-ray [BASE_IMAGE=...]      build $(RAY_IMAGE), the image plus Ray (compose/ray.yaml)
# make two-node | two-node-cpu | two-node-accelerate [ACCEL_GPU=1]      node0 and node1 in containers;
#   NODE0_NPROC=2 NODE1_NPROC=1 for uneven nodes, LINK_RATE=100mbit [LINK_DELAY=5ms] for a slower link.
#   They run the Compose project of `docker compose up` (named ddp in compose.yaml): `make two-node-down`
#   and `docker compose down --volumes` remove the same containers, network and snapshot volume.
# make STEP IN_DOCKER=1                any step above (single_gpu, multigpu, dataparallel, torchrun,
#                                      multinode, accelerate) inside $(IMAGE) instead of $(VENV)
IMAGE ?= ddp-examples:latest
RAY_IMAGE ?= ddp-examples-ray:latest
BASE_IMAGE ?=
LOCAL_BASE ?= local/ddp-base:bookworm
COMPOSE ?= docker compose
COMPOSE_CPU := -f compose.yaml
COMPOSE_GPU := $(COMPOSE_CPU) -f compose/gpu.yaml
NODE0_NPROC ?=
NODE1_NPROC ?=
LINK_RATE ?=
LINK_DELAY ?=
IN_DOCKER ?=
# A throwaway container of the image on the host network and process table, so that localhost rendezvous
# works and two containers started alike (make multinode) are told apart by their process ids; RUNS is kept
# in the named volume ddp-runs, so snapshots survive from one run to the next.
RUN_PREFIX := docker run --rm --network host --pid host --shm-size=1g $(if $(filter-out 0,$(GPUS)),--gpus all) \
  -e CUDA_VISIBLE_DEVICES -e TORCH_DISABLE_SHARE_RDZV_TCP_STORE -e OMP_NUM_THREADS -v ddp-runs:/app/runs $(IMAGE)
ifeq ($(IN_DOCKER),1)
PY := $(RUN_PREFIX) python
TORCHRUN := $(RUN_PREFIX) torchrun
# No local environment: the $(ENV) rule below then has no target and is ignored; the steps need the image.
ENV :=
single_gpu multigpu dataparallel torchrun multinode accelerate: image-current
endif
# $(call two_node,FILES): both nodes to the end; the exit status is node0's. A finished job's containers
# and volume are removed, so the next run starts fresh; a failed job's volume is kept, so the next run
# resumes from its snapshot. Plain `docker compose up` keeps the volume either way (see docs/docker.md).
two_node = export DDP_IMAGE=$(IMAGE) EPOCHS=$(EPOCHS) SAVE_EVERY=$(SAVE_EVERY) \
  $(foreach v,NODE0_NPROC NODE1_NPROC LINK_RATE LINK_DELAY,$(if $($(v)),$(v)=$($(v)))); \
  c="$(COMPOSE) $(1) $(if $(LINK_RATE)$(LINK_DELAY),--profile shaped)"; \
  if $$c up --abort-on-container-exit --exit-code-from node0; then $$c down --volumes; \
  else status=$$?; $$c down; exit $$status; fi
# (the Docker targets follow the steps below)

# `make help`: the targets by group, in this order ("Name:" opens a group, "_" is a space), each description
# wrapped within 100 characters, the make variables in it expanded. A target with "## " that no group names
# is listed last, under "Other", so that none is hidden (tests/repo/test_structure.py checks that none is).
HELP_GROUPS := Lessons: env single_gpu multigpu dataparallel torchrun multinode accelerate ray torchft \
  recipe recipe-accelerate diff GPT: gpt-data gpt tensorboard Docker: image image-ray image-current base-image two-node \
  two-node-cpu two-node-accelerate two-node-down two-node-failover two-node-torchft Engines: slurm-cluster \
  slurm-submit slurm-status slurm-down k8s-check Diagnostics: doctor pitfalls why-hung fault-demo \
  Benchmarks: bench bench-anchors bench-gpt bench-allreduce memory Tests_and_upkeep: gpu-check test test-quick test-fast lint \
  pins clean distclean help
HELP_AWK := BEGIN { n = split(groups, w, " "); for (i = 1; i <= n; i++) if (w[i] ~ /:$$/) { g = w[i]; \
  gsub("_", " ", g); order[++k] = g } else { of[w[i]] = g; rank[w[i]] = i } } \
  { d[$$1] = $$2; if (!($$1 in of)) { of[$$1] = "Other:"; rank[$$1] = 1000 + NR; order[k + 1] = "Other:" } } \
  END { for (j = 1; j <= k + 1; j++) { if (!(j in order)) continue; print order[j]; \
  for (r = 1; r <= 2000; r++) for (t in d) if (of[t] == order[j] && rank[t] == r) wrap(t, d[t]) } } \
  function wrap(t, text, line, m, i, word) { line = sprintf("  make %-20s", t); m = split(text, word, " "); \
  for (i = 1; i <= m; i++) { if (length(line) + 1 + length(word[i]) > 100) { print line; \
  line = sprintf("%27s", "") } line = line " " word[i] } print line }

help: ## list the targets, by group
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed -e 's|$$(VENV)|$(VENV)|g' \
	  -e 's|$$(GPT_DATA)|$(GPT_DATA)|g' | awk -F':.*## ' -v groups='$(HELP_GROUPS)' '$(HELP_AWK)'
	@echo "  variables: EPOCHS=$(EPOCHS) SAVE_EVERY=$(SAVE_EVERY) NPROC=$(NPROC) ARGS='$(ARGS)' RUNS=$(RUNS)"
	@echo "    VENV=$(VENV) GPUS=$(GPUS)"

env: $(ENV) ## create the pinned Python environment in $(VENV): pins/dev.txt, every group

# uv's pin and hashes (sed: its line to the last of its hash lines), then every pin by uv.
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set, every process would compile torch's sources anew
$(ENV): pins/dev.txt
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	sed -n '/^uv==/,/[^\\]$$/p' pins/dev.txt >$(VENV)/uv-pin.txt
	$(call retry,$(PY) -m pip install -q --require-hashes -r $(VENV)/uv-pin.txt)
	$(call retry,$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -r pins/dev.txt)
	$(PY) -c 'import torch, torchvision, accelerate, ray.train'
	touch $@

single_gpu: $(ENV) ## step 1: one device (GPU, else CPU)
	$(call step,single_gpu)

multigpu: $(ENV) ## step 2: DDP with mp.spawn, NPROC processes on this machine
	$(call step,multigpu)

dataparallel: $(ENV) ## step 2 the old way: nn.DataParallel, one process over every GPU (needs 2 or more)
	$(call step,multigpu_dataparallel)

torchrun: $(ENV) ## step 3: DDP launched by torchrun, resumes from snapshots
	$(call step,multigpu_torchrun)

multinode: $(ENV) ## step 4: two local "nodes", c10d rendezvous on localhost (GPUs split between them)
	$(call step,multinode)

accelerate: $(ENV) ## step 3 with Hugging Face Accelerate, launched by torchrun
	$(call step,multigpu_accelerate)

recipe: $(ENV) ## after step 3, the script to copy: digits, validation, bf16, --grad_accum, saves on SIGTERM
	$(call step,recipe)

# the same under accelerate launch, its one-node config, NPROC processes (the snapshot: a folder)
recipe-accelerate: SNAPSHOT = snapshot
recipe-accelerate: $(ENV) ## recipe.py in Accelerate's idiom, started by accelerate launch
	$(call step,recipe_accelerate)

ray: $(ENV) ## step 3 with Ray Train: a Ray cluster on this machine for the run, stopped after it
	$(call step,multigpu_ray)

diff: ## what each step adds to the previous one
	@set -- $(STEPS); while [ $$# -gt 1 ]; do diff -u examples/$$1.py examples/$$2.py; shift; done; \
	diff -u examples/multigpu_torchrun.py examples/multigpu_accelerate.py; \
	diff -u examples/multigpu_torchrun.py examples/multigpu_ray.py; \
	diff -u examples/multigpu_torchrun.py examples/multigpu_torchft.py; \
	diff -u examples/multigpu_torchrun.py examples/recipe.py; \
	diff -u examples/recipe.py examples/recipe_accelerate.py; \
	diff -u examples/single_gpu.py examples/multigpu_dataparallel.py; true

# ==== GPT: examples/gpt, a GPT trained with DDP (docs/gpt.md) =============================================
# make gpt-data [GPT_DATA_ARGS="my_texts/ --vocab_size 8192"]   text (default: the standard library) into a
#                                           BPE tokenizer and token shards in $(GPT_DATA) (examples/gpt/prepare.py)
# make gpt GPT_ARGS="--data runs/gpt-data --model gpt2"   train on them; GPT_ARGS: any option of train.py
# make gpt GPT_ARGS="--max_steps 1000"      any option of examples/gpt/train.py
# make gpt GPT_ARGS="--parallel fsdp"       or zero, tp, "pp --pp_schedule gpipe": beyond DDP (docs/parallelism.md)
# make bench-gpt GPT_BENCH_ARGS="--rounds 5"  2 DDP ranks of 1 thread vs one process of 2 threads (CPU);
#                                           then batches from memory-mapped shards vs the corpus in memory,
#                                           then TensorBoard and per-process times on vs JSON lines alone
# make memory MEMORY_ARGS="--strategies ddp"  memory per rank under each layout on 4 processes, vs the theory
GPT_ARGS ?=
GPT_DATA ?= $(RUNS)/gpt-data
GPT_DATA_ARGS ?=
GPT_BENCH_ARGS ?=
MEMORY_ARGS ?=
.PHONY: gpt gpt-data bench-gpt memory tensorboard

gpt-data: $(ENV) ## tokenize text into $(GPT_DATA): tokenizer.json, train.bin, val.bin, manifest.json
	$(PY) examples/gpt/prepare.py --out $(GPT_DATA) $(GPT_DATA_ARGS)

gpt: $(ENV) ## train the GPT with DDP on every local GPU (or 2 CPU processes); resumes from its snapshot
	$(TORCHRUN) --standalone --nproc-per-node=$(NPROC) examples/gpt/train.py \
	  --snapshot_path $(RUNS)/gpt/snapshot --metrics_path $(RUNS)/gpt/metrics.jsonl $(GPT_ARGS)

TB_PORT ?= 6006
tensorboard: $(ENV) ## TensorBoard on localhost:6006 (TB_PORT) for every run under RUNS (make gpt writes its metrics there)
	$(PY) -m tensorboard.main --logdir $(RUNS) --host 127.0.0.1 --port $(TB_PORT) --load_fast false

bench-gpt: $(ENV) ## GPT tokens/s: 2 DDP CPU processes vs one 2-thread process; shards vs in memory; metrics on vs off
	$(PY) benchmarks/gpt_throughput.py --out $(BENCH_OUT)/gpt.json $(GPT_BENCH_ARGS)
	$(PY) benchmarks/gpt_throughput.py --shards --out $(BENCH_OUT)/gpt-shards.json $(GPT_BENCH_ARGS)
	$(PY) benchmarks/gpt_throughput.py --metrics --out $(BENCH_OUT)/gpt-metrics.json $(GPT_BENCH_ARGS)

memory: $(ENV) ## GPT memory per rank (params, grads, optimizer state, peak) for each layout, 1-D and 2-D
	$(PY) benchmarks/gpt_memory.py --out $(BENCH_OUT) $(MEMORY_ARGS)
# ==== end GPT ============================================================================================

# ---- Docker and two nodes (variables above) ----
.PHONY: image image-ray image-current base-image two-node two-node-cpu two-node-accelerate two-node-down
.PHONY: two-node-failover two-node-torchft

image: ## build the Docker image (IMAGE=ddp-examples:latest; BASE_IMAGE=... replaces the CUDA base)
	@$(call need_base,$(or $(BASE_IMAGE),$(DEFAULT_BASE)),image)
	docker build --target runtime $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE) .

image-ray: ## the image plus Ray, for compose/ray.yaml (RAY_IMAGE=ddp-examples-ray:latest)
	@$(call need_base,$(or $(BASE_IMAGE),$(DEFAULT_BASE)),image-ray)
	docker build --target ray $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(RAY_IMAGE) .

# What the image is built from, as one checksum (docker/image-inputs.sh), which the Dockerfile writes into the
# image as well, with its base as the label ddp.base: the same whether make or `docker compose up` built it.
# The two-node targets and IN_DOCKER=1 build only when the image is missing, was built from other files, or
# on another BASE_IMAGE than one given; otherwise they run it as it is. A rebuild without BASE_IMAGE keeps
# the image's base, so a machine without a registry that built on local/ddp-base:bookworm keeps building on it.
IMAGE_SUM = $(shell docker/image-inputs.sh)
DEFAULT_BASE = $(shell sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
# $(call need_base,BASE,TARGET): BASE is here or pulled; else one line on building it offline, and exit 1
need_base = docker image inspect $(1) >/dev/null 2>&1 || docker pull -q $(1) >/dev/null 2>&1 || { echo \
  "cannot pull $(1) (no registry reachable?): build the base offline: make base-image, then \
  make $(or $(MAKECMDGOALS),$(2)) BASE_IMAGE=$(LOCAL_BASE)" >&2; exit 1; }
image-current: ## build the image only when it is missing or out of date (the two-node targets use this)
	@state=missing; if base=$$(docker image inspect -f '{{index .Config.Labels "ddp.base"}}' $(IMAGE) 2>/dev/null); \
	then state="out of date"; sum=$$(docker run --rm --network none --entrypoint cat $(IMAGE) /app/.image-inputs 2>/dev/null); fi; \
	base=$${base#<no value>}; [ "$$base" != default ] || base=$(DEFAULT_BASE); \
	if [ -n "$$sum" ] && [ "$$sum" = "$(IMAGE_SUM)" ] && [ -z "$(BASE_IMAGE)" -o "$$base" = "$(BASE_IMAGE)" ]; then \
	  echo "$(IMAGE) is up to date (built from these files on base $$base): not rebuilt"; \
	else \
	  given=$(or $(BASE_IMAGE),$$base); $(call need_base,$${given:-$(DEFAULT_BASE)},image-current); \
	  echo "$(IMAGE) is $$state: building it$${given:+ on $$given}"; \
	  set -x; docker build --target runtime $${given:+--build-arg BASE_IMAGE=$$given} -t $(IMAGE) .; \
	fi

base-image: ## build local/ddp-base:bookworm offline (debootstrap), for: make image BASE_IMAGE=...
	docker/build-base.sh $(LOCAL_BASE)

two-node: image-current ## two containers as two nodes, GPUs (NCCL), NPROC_PER_NODE=2 each
	$(call two_node,$(COMPOSE_GPU))

two-node-cpu: image-current ## two containers as two nodes, CPU (gloo), 2 processes each (as `docker compose up`)
	$(call two_node,$(COMPOSE_CPU))

two-node-accelerate: image-current ## the accelerate example across two containers (CPU; ACCEL_GPU=1 for GPUs)
	$(call two_node,$(if $(ACCEL_GPU),$(COMPOSE_GPU),$(COMPOSE_CPU)) -f compose/accelerate.yaml)

two-node-down: ## remove the two-node containers, network and snapshot volume (= docker compose down --volumes)
	$(COMPOSE) $(COMPOSE_CPU) --profile shaped down --volumes --remove-orphans

# FAILOVER_ARGS: options of demos/two_node_failover.py, e.g. --crash (root) or --epochs 80 --project NAME
FAILOVER_ARGS ?=
two-node-failover: image-current ## two nodes, elastic: node1 killed after a snapshot and started again; an account
	$(PYTHON3) demos/two_node_failover.py --image $(IMAGE) $(FAILOVER_ARGS)

# TORCHFT_ARGS: options of demos/two_node_torchft.py, e.g. --kill_epoch 10 --epochs 60 --port 29511
TORCHFT_ARGS ?=
two-node-torchft: image-current ## torchft replica groups in two containers: node1 killed, started again, healed live
	$(PYTHON3) demos/two_node_torchft.py --image $(IMAGE) $(TORCHFT_ARGS)

# one line, as make echoes it
doctor: DOCTOR_ARGS = $(if $(ENDPOINT), --endpoint $(ENDPOINT))$(if $(NODES), --nodes $(NODES))
doctor: DOCTOR_ARGS += $(if $(COLLECT_ENV),--collect_env)
doctor: $(ENV) ## check this machine: versions, GPUs, backends, network, ENDPOINT (NODES: all-reduce across them)
	$(PY) tools/doctor.py$(DOCTOR_ARGS)

# FAULT_ARGS: demos/fault.py's options (--dataset_size, --timeout, --rank)
FAULT_ARGS ?=
fault-demo: $(ENV) ## kill a torchrun worker after a snapshot, watch the run resume, compare (fault-tolerance.md)
	$(PY) demos/fault.py --dir $(RUNS)/fault-demo $(FAULT_ARGS)

torchft: $(ENV) ## step 3 with torchft: a lighthouse and two replica groups here; FT_ARGS=--kill kills one mid-run
	$(PY) demos/torchft_groups.py --dir $(RUNS)/torchft $(FT_ARGS)

pitfalls: $(ENV) ## the failures DDP users hit, each broken then fixed (examples/pitfalls): one line each
	$(PY) demos/pitfalls.py

# RUN: the folder whose hang/ holds the dumps that a timeout left (examples/gpt/failures/hang.py, docs/troubleshooting.md)
RUN ?=
.PHONY: why-hung
why-hung: $(ENV) ## which process hangs where, from the dumps of a timeout in RUN/hang: make why-hung RUN=FOLDER
	$(PY) tools/why_hung.py $(RUN)

# ==== Benchmarks: benchmarks/lessons.py (every launcher side by side) and benchmarks/allreduce.py ====
# make bench BENCH_ARGS=--full        longer runs; any option of benchmarks/lessons.py goes in BENCH_ARGS
# make bench-allreduce ALLREDUCE_ARGS="--max_bytes 16M"
BENCH_ARGS ?=
ALLREDUCE_ARGS ?=
BENCH_OUT ?= bench-results

bench: $(ENV) ## the lessons under every launcher, then the GPT (2 ranks vs 1 process, each strategy vs ddp)
	$(PY) benchmarks/lessons.py --out $(BENCH_OUT) $(BENCH_ARGS)
	$(PY) benchmarks/gpt_throughput.py --out $(BENCH_OUT)/gpt.json $(GPT_BENCH_ARGS)
	$(PY) benchmarks/gpt_throughput.py --strategies --rounds 2 --steps 40 --out $(BENCH_OUT)/gpt-strategies.json $(GPT_BENCH_ARGS)

bench-anchors: $(ENV) ## single_gpu.py vs the tutorial's loop, the GPT trainer vs nanoGPT's: 7 and 9 rounds
	$(PY) benchmarks/lessons.py --workloads tiny --variants plain tutorial tutorial_mse --tiny_size 2048 \
	  --epochs 100 --repeats 7 --out $(BENCH_OUT)/anchors $(BENCH_ARGS)
	$(PY) benchmarks/gpt_throughput.py --nanogpt --rounds 9 --steps 40 --global_batch 32 \
	  --out $(BENCH_OUT)/anchors/gpt-nanogpt.json

bench-allreduce: $(ENV) ## all-reduce algbw/busbw, 1K to 256M, vs a naive reduce+broadcast and memory copy
	$(TORCHRUN) --standalone --nproc-per-node=$(NPROC) benchmarks/allreduce.py \
	  --out $(BENCH_OUT)/allreduce-$(NPROC).json $(ALLREDUCE_ARGS)
# ==== end benchmarks =====================================================================================


gpu-check: $(ENV) ## on a GPU machine: the GPU tests, the layout matrix on NCCL, GPT-2 small compiled
	PY=$(PY) OUT=$(RUNS)/gpu-check DATA=$(GPT_DATA) $(if $(PARTS),PARTS='$(PARTS)') harness/gpu_check.sh

# LOAD=N: the tests beside N busy processes (harness/busy.py), as on a machine shared with other jobs
LOAD ?=
LOADED = $(if $(LOAD),$(PY) harness/busy.py $(LOAD) --)
# JOBS=N: test files run N at a time (pytest-xdist), each file whole on one worker; JOBS=0: one process
JOBS ?= 2
# whole files to each worker (each test of the few costs.py spreads), the costliest first (tests/costs.py)
PYTEST = $(PY) -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder
test: $(ENV) ## run the test suite (24 to 45 min on 2 CPU cores; see test-quick; LOAD=2: beside 2 busy)
	$(LOADED) $(PYTEST) $(TEST_ARGS)

# the tiers, by marker (pyproject.toml): CI runs everything
test-quick: $(ENV) ## the tests marked quick: the lessons and the README's commands (3 to 5 min on 2 cores)
	$(LOADED) $(PYTEST) -m quick $(TEST_ARGS)

test-fast: $(ENV) ## all but the Docker, Slurm, demo and slow tests (12 to 16 min on 2 cores)
	$(LOADED) $(PYTEST) -m "not docker and not slurm and not demo and not slow" $(TEST_ARGS)

lint: $(ENV) ## ruff (lint and format), shellcheck, hadolint, and make k8s-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	git ls-files -z '*.sh' .ci/run | xargs -0 $(VENV)/bin/shellcheck
	git ls-files -z 'Dockerfile' '*/Dockerfile' | xargs -0 -r $(VENV)/bin/hadolint
	$(PY) harness/k8s_check.py

# K8S_CRD_DIR: the Kubeflow Trainer CRDs (default: shared/k8s beside the repository); docs/kubernetes.md
k8s-check: $(ENV) ## check k8s/ as a cluster would: kustomize, strict Kubernetes schemas, the TrainJob CRD
	$(PY) harness/k8s_check.py

# pins/dev.txt first, keeping the versions it has where they still fit; the smaller groups constrained to it,
# so that every group gets the versions `make env` installs. For Python 3.11 and 3.12 alike.
PIN_FLAGS := -q --universal --python-version 3.11 --generate-hashes --no-annotate --custom-compile-command 'make pins'
pins: $(ENV) ## re-compile pins/GROUP.txt from pyproject.toml's dependency groups runtime, ray and dev
	$(VENV)/bin/uv pip compile $(PIN_FLAGS) --group dev -o pins/dev.txt
	for group in runtime ray; do \
	  $(VENV)/bin/uv pip compile $(PIN_FLAGS) --group $$group -c pins/dev.txt -o pins/$$group.txt || exit 1; done

# GPT_CACHE: where the GPT trainer keeps downloaded and prepared corpora (examples/gpt/config.py, --cache_dir)
GPT_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ddp-examples
clean: ## remove snapshots, logs and caches, the GPT corpora cache included; name what Ray keeps
	rm -rf $(RUNS) .pytest_cache .ruff_cache *_snapshot.pt gpt_snapshot metrics.jsonl "$(GPT_CACHE)"
	@for kept in "$(HOME)/ray_results" "$(HOME)/.ray" /tmp/ray; do \
		if [ -e "$$kept" ]; then echo "kept $$kept: Ray's, shared with every Ray program (rm -rf it yourself)"; fi; \
	done

distclean: clean ## also remove the Python environment
	rm -rf $(VENV)

# ---- Slurm -------------------------------------------------------------------------------------------------
# A two-node Slurm cluster on this machine (harness/slurm_cluster.sh: root, with slurm-wlm and munge installed),
# and the batch job examples/slurm/sbatch_run.sh submitted to it. On a real cluster, use sbatch directly.
SLURM_CLUSTER := harness/slurm_cluster.sh
# sbatch options for slurm-submit: the local nodes have 2 CPUs each, so 2 training processes per node.
SBATCH_ARGS ?= --cpus-per-task=2 --time=00:10:00
.PHONY: slurm-cluster slurm-submit slurm-status slurm-down

slurm-cluster: ## start a two-node Slurm cluster on this machine (root; needs slurm-wlm and munge)
	$(SLURM_CLUSTER) up

slurm-submit: $(ENV) ## sbatch the Slurm example to that cluster, print its output as it comes, wait for the end
	@eval "$$($(SLURM_CLUSTER) env)"; mkdir -p $(RUNS)/$@; \
	job=$$(TORCHRUN="$(abspath $(PY)) $(abspath tools/launch.py)" SNAPSHOT_PATH="$(abspath $(RUNS))/$@/snapshot.pt" \
	  sbatch --parsable --output=$(RUNS)/$@/%x-%j.out $(SBATCH_ARGS) \
	  examples/slurm/sbatch_run.sh $(EPOCHS) $(SAVE_EVERY) $(ARGS)) || exit; \
	out=$(RUNS)/$@/ddp-multinode-$$job.out; echo "job $$job, output in $$out"; \
	shown=0; while :; do \
	  running=$$(squeue -h -j $$job 2>/dev/null); \
	  if [ -f $$out ]; then size=$$(stat -c %s $$out); tail -c +$$((shown + 1)) $$out | head -c $$((size - shown)); shown=$$size; fi; \
	  [ -n "$$running" ] || break; sleep 2; \
	done; \
	state=$$(scontrol show job $$job | grep -o 'JobState=[A-Z_]*'); echo "job $$job: $$state"; \
	[ "$$state" = JobState=COMPLETED ]

slurm-status: ## nodes and jobs of that cluster
	$(SLURM_CLUSTER) status

slurm-down: ## stop that cluster and remove what it set up
	$(SLURM_CLUSTER) down
