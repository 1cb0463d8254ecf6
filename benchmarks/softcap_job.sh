#!/usr/bin/env bash
# The soft-capped head (Gemma 2's cap of 30) on one GPU, for several versions of the package in one job:
#
#   benchmarks/softcap_job.sh OUT NAME=PKG [NAME=PKG ...]
#
# PKG is a copy of the lce_flax/ package folder (e.g. from one `git archive`; NAME names its commit, which the
# results record); each runs from a copy of this repository with its lce_flax/ swapped in, so the benchmarks are
# this tree's. Per version: bench_step_products --check (auto against the plain head, in alternation) with the cap
# at SHAPES (into OUT/NAME-cap/) and without it at PLAIN_SHAPES (OUT/NAME-nocap/), and the ptxas report
# (registers, spill bytes) of every kernel of the capped step at gemma2-2b (MOSAIC_GPU_DUMP_PTXAS, into
# OUT/NAME/). Then, with this tree's package, bench_epilogue's forward variants with and without the cap (into
# OUT/epilogue/; NO_EPILOGUE=1: not). Versions run one after another: compare ratios within a version's rows, not
# times across versions.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift
ROOT=$PWD
SHAPES=${SHAPES:-gemma2-2b}
PLAIN_SHAPES=${PLAIN_SHAPES-gemma2-2b,llama3-8b}  # (set empty: none)
ROUNDS=${ROUNDS:-3}
for spec in "$@"; do
  name=${spec%%=*}; pkg=${spec#*=}
  tree=$(mktemp -d); cp -r "$ROOT"/. "$tree"/; rm -rf "$tree/lce_flax"; cp -r "$pkg" "$tree/lce_flax"
  mkdir -p "$OUT/$name"
  echo "=== $name ($pkg)"
  (cd "$tree" && export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} LCE_FLAX_COMMIT=$name &&
   python3 -m benchmarks.bench_step_products --check --logit-softcap 30 --shapes "$SHAPES" --rounds "$ROUNDS" \
     --out "$OUT/$name-cap" 2>&1 | grep -v "^#" | tail -n 5
   if [ -n "$PLAIN_SHAPES" ]; then
     python3 -m benchmarks.bench_step_products --check --shapes "$PLAIN_SHAPES" --rounds "$ROUNDS" \
       --out "$OUT/$name-nocap" 2>&1 | grep -v "^#" | tail -n 5
   fi
   MOSAIC_GPU_DUMP_PTXAS=1 python3 - > "$OUT/$name/ptxas_gemma_cap.txt" 2>&1 <<'PY'
import jax
from benchmarks import bench
from benchmarks.bench_floors import SHAPES, head_steps
x, w, y = bench.make_inputs(SHAPES["gemma2-2b"])
for step in head_steps(y, True, False, 30.0).values():
  step.lower(x, w).compile()
PY
   grep -i -E "spill|registers" "$OUT/$name/ptxas_gemma_cap.txt" | sort | uniq -c | head -n 20)
  rm -rf "$tree"
done
echo "=== epilogue variants (this tree)"
[ -n "${NO_EPILOGUE:-}" ] && exit 0
python3 -m benchmarks.bench_epilogue --out "$OUT/epilogue" --shapes gemma2-2b,llama3-8b --rounds "$ROUNDS" \
  --variants xla,bare,stats_fast,exp_fast,stats_cap,exp_cap 2>&1 | grep -v "^#" | tail -n 14
