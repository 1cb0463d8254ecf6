#!/usr/bin/env bash
# One GPU session of the benchmarks: our implementations (and tokamax's) at the four LLM shapes, the PyTorch peers
# at the same shapes, then the tables and plots — every ratio measured in one lease.
#
#   bash benchmarks/run_gpu.sh            # from the repository root; writes into $OUT (else /tmp/lce_bench/gpu)
#
# Optional wheels in .whl/ (tokamax and its small dependencies, liger-kernel, cut-cross-entropy, jax-triton) are
# installed with pip --target first; without them those rows are recorded as unavailable.
# Knobs (environment): IMPLS (default below), MODES (fast,lean), BENCH_BUDGET_S (300), PEERS (all four),
# PEERS_BUDGET_S (160), PEERS_PASSES (fwdbwd: torch.compile compiles once per shape and pass), SWEEP_BUDGET_S
# (0: no sweep; the sweep preset wants a call of its own, ~5 min), PY (python3).
# Each stage runs under a hard `timeout` 40 s past its budget (KILL 10 s later), so the whole fits a 10-min call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lce_bench/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
IMPLS=${IMPLS:-chunked,pallas_mosaic,pallas_triton,triton,xla,tokamax_xla,tokamax_chunked_xla}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-300}
PEERS_BUDGET_S=${PEERS_BUDGET_S:-160}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-0}
PY=${PY:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; } 2>&1 | tee "$LOG"

# absl's autotuning-cache warnings (tokamax) are noise; everything else goes to the log.
quiet() { grep --line-buffered -v '^WARNING:absl:Autotuning cache miss'; }

timeout -k 10 -s TERM $((BENCH_BUDGET_S + 40)) $PY -m benchmarks.bench --preset llm --impls "$IMPLS" \
  --modes "${MODES:-fast,lean}" --budget-s "$BENCH_BUDGET_S" --out "$OUT" --no-report 2>&1 | quiet | tee -a "$LOG"

timeout -k 10 -s TERM $((PEERS_BUDGET_S + 40)) $PY -m benchmarks.bench_torch_peers --preset llm \
  --impls "${PEERS:-torch_compile,cce,liger_flce,torch_eager}" --passes "${PEERS_PASSES:-fwdbwd}" --budget-s "$PEERS_BUDGET_S" --out "$OUT" 2>&1 \
  | tee -a "$LOG"

if [ "$SWEEP_BUDGET_S" -gt 0 ]; then
  timeout -k 10 -s TERM $((SWEEP_BUDGET_S + 40)) $PY -m benchmarks.bench --preset sweep --impls "${SWEEP_IMPLS:-$IMPLS}" \
    --modes "${MODES:-fast,lean}" --budget-s "$SWEEP_BUDGET_S" --out "$OUT" --no-report 2>&1 | quiet | tee -a "$LOG"
fi

$PY -m benchmarks.plots "$OUT" 2>&1 | tee -a "$LOG"
ls -la "$OUT"
sed -n '1,/^!\[/p' "$OUT/results.md"  # the LLM table, last in the call's output
