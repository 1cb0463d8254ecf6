#!/usr/bin/env bash
# Tile orders of the forward GEMM ranked by the DRAM bytes they read, then timed (one GPU, Nsight Compute):
#
#   benchmarks/order_sweep.sh OUT [SHAPES]
#
# At the power limit a GEMM's time is its energy, and at llama3-8b the package's forward reads 1.6x the DRAM
# bytes cuBLAS reads (benchmarks/results/ncu-forward-h200-2026-11-29/); one launch's reads move by up to 37%
# between runs, so neither one launch nor time alone ranks tile orders. Per shape:
#   1. ncu_forward --sweep: the table's rows of `bare`, `stats` and `store` (roles fwd, fwd_stats, fwd_store) and
#      each change of ORDERS, REPEATS launches each, one ncu process per change, the changes not reached within
#      BUDGET_S seconds (default 300) skipped -> OUT/ncu/ (ncu_forward.json, ncu_forward.log as it runs,
#      picks.json: the PICK changes of fewest bytes summed over the three variants). All 33 kernels of
#      llama3-8b in one ncu process did not finish within 570 s on an H200;
#   2. bench_epilogue --configs: the rows and the picked changes, timed in alternation (ROUNDS) with their outputs
#      checked equal to the rows' -> OUT/time-SHAPE/results.json.
# A picked order goes into the tuning table only after the whole step and benchmarks/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1
SHAPES=${2:-llama3-8b,gemma2-2b,qwen3-8b}
ORDERS=${ORDERS:-"order_minor=m;order_minor=m,order_width=16;order_minor=m,order_width=4;order_width=16;order_width=4;order_minor=m,order_width=32;order_width=32;cluster=m;cluster=m,order_minor=m;cluster=None"}
REPEATS=${REPEATS:-3}
PICK=${PICK:-3}
ROUNDS=${ROUNDS:-5}
export BUDGET_S=${BUDGET_S:-300}
mkdir -p "$OUT/ncu"
python3 -m benchmarks.ncu_forward --sweep --shapes "$SHAPES" --variants bare,stats,store --changes "$ORDERS" \
  --repeats "$REPEATS" --pick "$PICK" --out "$OUT/ncu" 2>&1 | cut -c1-400
for shape in ${SHAPES//,/ }; do
  picks=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ''))" \
            "$OUT/ncu/picks.json" "$shape" 2>/dev/null)
  echo "=== $shape: timing the rows and [$picks]"
  [ -n "$picks" ] || continue
  python3 -m benchmarks.bench_epilogue --shapes "$shape" --variants bare,stats_fast,exp_fast --configs "$picks" \
    --rounds "$ROUNDS" --out "$OUT/time-$shape" 2>&1 | grep '"ms"' | cut -c1-200
done
