#!/usr/bin/env bash
# The GPU benchmark run: the plain head, auto and every implementation (and tokamax's) at the four LLM shapes, the
# PyTorch peers at the same shapes, optionally the V/B/H sweep and the GPU tests, then the tables and plots. Every
# stage runs on one machine in one go, so every ratio in the tables is measured on one machine.
#
#   bash benchmarks/run_gpu.sh            # from the repository root; writes into $OUT (else /tmp/lce_bench/gpu)
#
# Optional wheels in .whl/ (tokamax and its small dependencies, liger-kernel, cut-cross-entropy, jax-triton) are
# installed with pip --target first; without them those rows are recorded as unavailable.
# Knobs (environment):
#   IMPLS          rows of bench.py (default below: the plain heads, auto, every implementation, tokamax's)
#   MODES          fast,lean
#   BENCH_TIME_S   300   time limit of the llm preset (what is left is recorded as skipped)
#   PEERS          torch_compile,cce,liger_flce,torch_eager (cce_exact: CCE without its gradient filter);
#                  PEERS_TIME_S 160;  PEERS_PASSES fwdbwd
#   SWEEP_TIME_S   0     >0 also runs the sweep preset (~5 min; a run of its own fits best)
#   BENCH_ARGS     extra arguments of bench.py's llm and llm32k runs (e.g. "--passes fwdbwd --order shape")
#   LLM32K_TIME_S  0     >0 also runs the llm32k preset (32768 tokens) with LLM32K_IMPLS (plain_bf16,plain_f32,auto)
#                  and LLM32K_MODES (default: MODES)
#   PEERS32K_TIME_S 0    >0 also runs the PyTorch peers (PEERS32K, default PEERS) at the llm32k preset
#   TESTS          0     1 first runs the GPU tests (pytest -m gpu)
#   PY             python3
# Each stage runs under a hard `timeout` 40 s past its time limit (KILL 10 s later).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lce_bench/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
IMPLS=${IMPLS:-plain_bf16,plain_f32,auto,pallas_mosaic,chunked,pallas_triton,pallas_triton:low_memory,triton,xla,tokamax_xla,tokamax_chunked_xla}
BENCH_TIME_S=${BENCH_TIME_S:-300}
PEERS_TIME_S=${PEERS_TIME_S:-160}
SWEEP_TIME_S=${SWEEP_TIME_S:-0}
TESTS=${TESTS:-0}
PY=${PY:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; } 2>&1 | tee "$LOG"

# absl's autotuning-cache warnings (tokamax) are noise; everything else goes to the log.
quiet() { grep --line-buffered -v '^WARNING:absl:Autotuning cache miss'; }

if [ "$TESTS" -gt 0 ]; then
  timeout -k 10 -s TERM 600 $PY -m pytest -q -m gpu tests 2>&1 | tee -a "$LOG"
fi

timeout -k 10 -s TERM $((BENCH_TIME_S + 40)) $PY -m benchmarks.bench --preset llm --impls "$IMPLS" \
  --modes "${MODES:-fast,lean}" --time-limit-s "$BENCH_TIME_S" --out "$OUT" --no-report ${BENCH_ARGS:-} 2>&1 | quiet \
  | tee -a "$LOG"

timeout -k 10 -s TERM $((PEERS_TIME_S + 40)) $PY -m benchmarks.bench_torch_peers --preset llm \
  --impls "${PEERS:-torch_compile,cce,liger_flce,torch_eager}" --passes "${PEERS_PASSES:-fwdbwd}" \
  --time-limit-s "$PEERS_TIME_S" --out "$OUT" 2>&1 | tee -a "$LOG"

LLM32K_TIME_S=${LLM32K_TIME_S:-0}
if [ "$LLM32K_TIME_S" -gt 0 ]; then
  timeout -k 10 -s TERM $((LLM32K_TIME_S + 40)) $PY -m benchmarks.bench --preset llm32k \
    --impls "${LLM32K_IMPLS:-plain_bf16,plain_f32,auto}" --modes "${LLM32K_MODES:-${MODES:-fast,lean}}" \
    --time-limit-s "$LLM32K_TIME_S" --out "$OUT" --no-report ${BENCH_ARGS:-} \
    2>&1 | quiet | tee -a "$LOG"
fi

PEERS32K_TIME_S=${PEERS32K_TIME_S:-0}
if [ "$PEERS32K_TIME_S" -gt 0 ]; then
  timeout -k 10 -s TERM $((PEERS32K_TIME_S + 40)) $PY -m benchmarks.bench_torch_peers --preset llm32k \
    --impls "${PEERS32K:-${PEERS:-torch_compile,cce,liger_flce,torch_eager}}" --passes "${PEERS_PASSES:-fwdbwd}" \
    --time-limit-s "$PEERS32K_TIME_S" --out "$OUT" 2>&1 | tee -a "$LOG"
fi

if [ "$SWEEP_TIME_S" -gt 0 ]; then
  timeout -k 10 -s TERM $((SWEEP_TIME_S + 40)) $PY -m benchmarks.bench --preset sweep --impls "${SWEEP_IMPLS:-$IMPLS}" \
    --modes "${MODES:-fast,lean}" --time-limit-s "$SWEEP_TIME_S" --out "$OUT" --no-report 2>&1 | quiet | tee -a "$LOG"
fi

$PY -m benchmarks.plots "$OUT" 2>&1 | tee -a "$LOG"
ls -la "$OUT"
sed -n '1,/^!\[/p' "$OUT/results.md"  # the LLM table, last in the output
