#!/usr/bin/env bash
# The GPU speed figures in one call on a CUDA machine, into one folder:
#   bench   `python -m tools.bench_all --only gpu`: bf16 and fp16 matmul peaks; the UniLM-large model step
#           (32 x 512, 77 masked positions, dropout on) eager, with each fast path and both, vs
#           transformers.BertForPreTraining; pretrain.train (ZeRO-2, batch 330 = 33 x 10) in bf16 and fp16 at 512
#           tokens, bf16 at 128, then bf16 at 512 again with one sample per row (train.pack_samples=false); every
#           ratio against its target -> OUT/results.md, OUT/results.json, OUT/bench.log
#   tests   the fast paths' `-m gpu` tests (bf16/fp16 accuracy of the chunked loss and the compiled blocks)
#           -> OUT/gpu_tests.log
#   suite   the whole `-m gpu` test suite (training runs, resume, ZeRO-3, offload, fine-tuning) -> OUT/gpu_suite.log
#
#   tools/gpu_speed.sh [OUT=bench_out/gpu_speed] [bench|tests|suite|all (= bench and tests)]
#
# Where torch sees no CUDA GPU it exits 2 and writes nothing (the CPU figures are `make bench`).
# For one short device lease (at most 6 minutes) there is `make gpu-check` (tools/gpu_check.py) instead.
#
# OUT receives the reports alone (machine.txt, bench.log, results.md, results.json, gpu_partial.json -- what is
# measured so far, rewritten after each part --, gpu_model.json, the test logs); what the benchmark builds and runs
# (shards, training runs, their logs) goes to GPU_SPEED_WORK (default OUT/work). Every part streams its output into
# bench.log as it runs, so a run stopped by a time limit keeps its progress and the parts it finished.
#
# Expected run time on one H200 (an estimate: this script has not run on a GPU yet): bench 10-13 min (two
# compilations of UniLM-large in bench_model, four training processes with a FusedAdam build, compilation and a
# 4 GB checkpoint save each; the parts run most important first), tests 2-3 min, suite 10-15 min. Needs a CUDA torch and the two sample corpora the
# shards are built from, data/samples/wiki and data/samples/books.jsonl (7 MB; `make sample-corpus` fetches them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out/gpu_speed}
WHAT=${2:-all}
case $WHAT in bench|tests|suite|all) ;; *) echo "usage: $0 [OUT] [bench|tests|suite|all], not '$WHAT'" >&2; exit 2;; esac
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 || echo python )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! TORCH=$("$PY" -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda)
sys.exit(not torch.cuda.is_available())'); then
  echo "$0: needs a CUDA GPU, and torch sees none here ($TORCH); the CPU figures are make bench" >&2
  exit 2
fi
mkdir -p "$OUT"
{ nvidia-smi || true; echo "$TORCH"; } > "$OUT/machine.txt" 2>&1
status=0
if [[ $WHAT == bench || $WHAT == all ]]; then
  "$PY" -m tools.bench_all --only gpu --out "$OUT" --work "${GPU_SPEED_WORK:-$OUT/work}" 2>&1 \
    | tee "$OUT/bench.log" || status=1
fi
if [[ $WHAT == tests || $WHAT == all ]]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/pretrain/test_kernels.py tests/pretrain/test_model.py \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
if [[ $WHAT == suite ]]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_suite.log" || status=1
fi
exit $status
