#!/usr/bin/env bash
# A device's own tuning rows for the op's GEMMs, measured on that device (one GPU):
#
#   bash benchmarks/device_rows.sh OUT [STAGES]          STAGES: any of "forward sweep steps lean check"
#                                                         (default: "sweep steps check")
#
#   forward the forward's rows: bench_gemm.py --sweep of the bare x·w (PRODUCTS=fwd), then its loss-work roles
#           (fwd_stats, the lean forward; fwd_store, the fast one), each from the table's row for that role and
#           the bare product's two best configs, the fastest in alternation; OUT/forward/gemm_tuning.json, merged
#   sweep   bench_gemm.py --sweep of dx and dw at the heads (PRODUCTS=dx,dw, bare products, no example matmul):
#           the table's row for this device first, then the grid; the fastest of each goes to
#           OUT/sweep/gemm_tuning.json and is merged into this tree's table
#   steps   bench_step_products.py: the fast step with each pair of backward products (ours or XLA's) against the
#           plain head, on the table as merged; OUT/steps/steps.json merged too
#   lean    bench_step_products.py --mode lean: lean mode's step with each pair of chunk products (each at the
#           width the op plans for it, and at the narrower LEAN_WIDTHS, e.g. 3072,3328: the row keeps each pair's
#           fastest width, which the op then runs) against the plain head; with LEAN_BLOCKS (e.g. 8192,4096) the
#           GEMM's pair also in those blocks of tokens at every width of LEAN_WIDTHS; LEAN_PAIRS (e.g. "gemm,gemm")
#           times only those pairs; OUT/lean/steps.json merged (design "recompute")
#   check   bench_step_products.py --check: the plain head against auto as the merged table picks it
#
# OUT/gemm_tuning.json is the table as merged: to land the rows, merge the stages' files of OUT into the package's
# table here (python3 -m benchmarks.tuning_table OUT/sweep/gemm_tuning.json OUT/steps/steps.json) and run
# gpu_check.sh. Each stage writes its own folder of OUT (forward/ and sweep/ with their .jsonl, steps/, check/), so
# stages can run in separate jobs, the earlier stages' files merged into the table before the later ones run.
# Env: SHAPES (default the four LLM heads), SWEEP_BUDGET_S (300: the sweep stops starting products after it),
# ROUNDS (3: alternated rounds of steps and check), LEAN_WIDTHS, LEAN_BLOCKS, LEAN_PAIRS (none), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: device_rows.sh OUT [STAGES]}
STAGES=${2:-sweep steps check}
PY=${PYTHON:-python3}
SHAPES=${SHAPES:-llama3-8b,qwen3-8b,gemma2-2b,gpt2-small}
ROUNDS=${ROUNDS:-3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
TABLE=lce_flax/_impl/pallas_mosaic/gemm_tuning.json
status=0

gemm_rows() {  # gemm_rows NAME PRODUCTS [bench_gemm args]: the products swept into OUT/NAME, their rows merged
  local name=$1 products=$2
  shift 2
  SHAPES=$SHAPES PRODUCTS=$products BUDGET_S=${SWEEP_BUDGET_S:-300} \
    $PY -m benchmarks.bench_gemm --sweep --no-example "$@" --out "$OUT/$name" >"$OUT/$name.jsonl" || status=1
  grep '"summary"\|"fused"' "$OUT/$name.jsonl"
  [ -f "$OUT/$name/gemm_tuning.json" ] && $PY -m benchmarks.tuning_table "$OUT/$name/gemm_tuning.json"
}

for stage in $STAGES; do
  echo "== $stage ($(date -u +%T))"
  case $stage in
    forward) gemm_rows forward fwd ;;
    sweep) gemm_rows sweep dx,dw --no-fused ;;
    steps)
      $PY -m benchmarks.bench_step_products --shapes "$SHAPES" --rounds "$ROUNDS" --out "$OUT/steps" || status=1
      [ -f "$OUT/steps/steps.json" ] && $PY -m benchmarks.tuning_table "$OUT/steps/steps.json" ;;
    lean)
      $PY -m benchmarks.bench_step_products --mode lean --shapes "$SHAPES" --rounds "$ROUNDS" --out "$OUT/lean" \
        ${LEAN_WIDTHS:+--widths "$LEAN_WIDTHS"} ${LEAN_BLOCKS:+--blocks "$LEAN_BLOCKS"} \
        ${LEAN_PAIRS:+--pairs "$LEAN_PAIRS"} || status=1
      [ -f "$OUT/lean/steps.json" ] && $PY -m benchmarks.tuning_table "$OUT/lean/steps.json" ;;
    check)
      $PY -m benchmarks.bench_step_products --check --shapes "$SHAPES" --rounds "$ROUNDS" --out "$OUT/check" \
        || status=1 ;;
    *) echo "unknown stage $stage (expected forward, sweep, steps, lean, check)"; exit 2 ;;
  esac
done
cp "$TABLE" "$OUT/gemm_tuning.json"
echo "== done ($(date -u +%T)), status $status"
exit $status
