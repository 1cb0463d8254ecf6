#!/usr/bin/env bash
# Everything the docs promise on a GPU, in one run of at most 9.5 minutes on one H100 (16 CPU cores): run it before
# submitting any kernel change, and commit its log under benchmarks/results/.
#
#   benchmarks/gpu_check.sh [LOG]      LOG: a file, or a folder for gpu-check-<date>.log
#                                      (default: $OUT if set, else benchmarks/results/)
#
# 1. the example trainer's GPU preset for a few steps with each head (the fused head trains; the plain head's step at
#    the same batch is compiled and timed), and with GPU_CHECK_HEADROOM=1 the headroom preset (V = 256000, 65536
#    tokens a step), where the plain head does not fit;
# 2. README.md's code blocks, each in turn in one namespace (later blocks use the names of earlier ones), on the GPU;
#    with one GPU, the Multi-GPU block (and tests/test_readme.py, if present) on 8 simulated CPU devices;
# 3. every `-m gpu` test, with pytest-xdist, four workers a GPU (-n 4 on one; on N GPUs 4·N workers, each seeing
#    one GPU): XLA_PYTHON_CLIENT_PREALLOCATE=false and a memory fraction per worker, so that the workers compile in
#    parallel on the CPU cores and share a GPU's memory; the slowest tests are listed (--durations). It gets the time
#    left of GPU_CHECK_SECONDS (default 570);
# 4. with 2 or more GPUs: the trainer's fused step compiled on a data-parallel mesh of 2 against one GPU at the same
#    per-device batch (the bytes alive at once per device should not grow; the temporaries' ratio is printed).
# Each section has a time limit; the log ends with one line per section and the script exits non-zero if any failed.
# GPU_CHECK_SECTIONS picks sections by number (default "1 2 3 4"; e.g. "4" for the two-GPU memory check alone): a
# log of fewer sections says so and is not the check a kernel change needs.
# PYTHON selects the interpreter (default python3); the repository need not be installed (PYTHONPATH is set).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DAY=$(date -u +%F)
dest=${1:-${OUT:-benchmarks/results}}
if [ -d "$dest" ] || [ "${dest%/}" != "$dest" ]; then
  mkdir -p "$dest"
  LOG="${dest%/}/gpu-check-$DAY.log"
else
  mkdir -p "$(dirname "$dest")"
  LOG=$dest
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LCE_FLAX_CACHE="$WORK/cache"  # the trainer's corpus and tokenizers, shared by its runs below
exec > >(tee "$LOG") 2>&1

declare -a SUMMARY=()
failed=0
SECTIONS=" ${GPU_CHECK_SECTIONS:-1 2 3 4} "
want() { [[ "$SECTIONS" == *" $1 "* ]]; }  # want N: section N was asked for
section() {  # section NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, records its status and seconds
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS rc=0
  # (through bash -c, so that a section may be one of the functions below; they and their variables are exported)
  timeout --signal=INT --kill-after=15 "$limit" bash -c '"$@"' _ "$@" || rc=$?
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMED OUT"; failed=1
  elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; failed=1; fi
  SUMMARY+=("$(printf '%-34s %-18s %4ds' "$name" "$status" $((SECONDS - t0)))")
}

echo "lce_flax GPU check, $(date -u '+%F %T') UTC"
# Optional wheels a bare GPU image lacks (jax-triton for impl="triton"), carried in .whl/ (see benchmarks/README.md).
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$WORK/site" && echo "installed from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
if ! "$PY" -c "import jax_triton" 2>/dev/null; then
  echo "jax_triton: not importable here (no .whl/ carried, or not installed): the impl='triton' tests will skip"
fi
# (LCE_FLAX_COMMIT names the commit where the tree is a copy without git, e.g. `git archive` of it)
echo "commit: ${LCE_FLAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null \
  || echo ' (with uncommitted changes)')}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null \
  | sed 's/^/gpu: /' || echo "gpu: nvidia-smi not found"
echo "cpu cores: $(nproc)"
[ "$SECTIONS" = " 1 2 3 4 " ] || echo "sections run: $SECTIONS(GPU_CHECK_SECTIONS): not the whole check"
if [ "${GPU_CHECK_SECONDS:-570}" -lt 570 ]; then  # (the tests alone took ~310 s of it on one H100, 2026-11-28)
  echo "time limit: GPU_CHECK_SECONDS=$GPU_CHECK_SECONDS, under the 570 s the whole check is given: its tests may be" \
    "stopped before they end, and a check stopped so does not pass"
fi
"$PY" - <<'EOF'
import importlib.metadata as md, platform
names = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "numpy",
         "triton", "jax-triton", "tokenizers", "pytest", "pytest-xdist"]
have = []
for n in names:
  try:
    have.append(f"{n} {md.version(n)}")
  except md.PackageNotFoundError:
    pass
print(f"python {platform.python_version()}; " + ", ".join(have))
import jax
print(f"jax devices: {jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
EOF
NGPU=$("$PY" -c 'import jax; print(jax.device_count() if jax.default_backend() == "gpu" else 0)' 2>/dev/null || echo 0)
if [ "$NGPU" -lt 1 ]; then
  echo "no GPU visible to JAX: this check needs one"
  exit 2
fi

# 1. The trainer's presets, a few steps: the fused head trains (loss, held-out loss, memory, tokens/s), then the
#    plain head's step at the same batch is compiled and timed in the same process (or reported as not fitting).
#    The check then reads train_lm.json: the fused head must have trained (finite losses), and at the gpu preset
#    the plain head must fit too.
trainer() {  # trainer PRESET PLAIN_MUST_FIT
  "$PY" examples/train_lm.py --preset "$1" --steps 6 --eval-every 0 --eval-batches 1 --bench-steps 2 \
    --sample-tokens 0 --quiet --out "$WORK/$1" || return
  "$PY" - "$WORK/$1/train_lm.json" "$2" <<'EOF'
import json, math, sys
r = json.load(open(sys.argv[1]))
fused, plain = r["runs"]["fused"], r["same_batch"]["plain"]
ok = fused["fits"] and all(math.isfinite(x) for x in fused["losses"]) and len(fused["losses"]) == 6
print(f"check: fused trained {len(fused.get('losses', []))} steps: {'ok' if ok else 'NO'}; plain at the same batch: "
      + ("fits" if plain["fits"] else f"does not fit ({plain.get('error')})"))
sys.exit(0 if ok and (plain["fits"] or sys.argv[2] != "yes") else 1)
EOF
}
export PY WORK NGPU
export -f trainer
want 1 && section "trainer --preset gpu" 120 trainer gpu yes
# The headroom preset (the plain head does not fit) takes ~90 s more: GPU_CHECK_HEADROOM=1 adds it.
if want 1 && [ "${GPU_CHECK_HEADROOM:-0}" = 1 ]; then
  section "trainer --preset headroom" 150 trainer headroom no
fi

# 2. README.md's code blocks.
readme_blocks() {
  "$PY" - <<'EOF'
import re, sys, time, traceback
import jax
text = open("README.md").read()
blocks = re.findall(r"```python\n(.*?)```", text, re.S)
ns, bad, where = {"__name__": "__readme__"}, 0, f"{jax.device_count()} {jax.default_backend()} device(s)"
for i, src in enumerate(blocks, 1):
  if "device_count() // 2" in src and jax.device_count() < 2:
    print(f"block {i}/{len(blocks)} on {where}: not run here (its mesh needs 2 or more devices)")
    continue
  t0 = time.perf_counter()
  try:
    exec(compile(src, f"README.md python block {i}", "exec"), ns)
    print(f"block {i}/{len(blocks)} on {where}: ok ({time.perf_counter() - t0:.1f} s)")
  except Exception:
    bad += 1
    print(f"block {i}/{len(blocks)} on {where}: FAILED\n" + "".join(traceback.format_exc().splitlines(True)[-4:]))
sys.exit(1 if bad else 0)
EOF
}
readme() {  # on the GPU (blocks whose mesh needs 2 devices left out on one), then tests/test_readme.py (or the
            # blocks again), on 8 simulated CPU devices where there is one GPU
  local rc=0
  readme_blocks || rc=$?
  if [ -f tests/test_readme.py ]; then
    if [ "$NGPU" -ge 2 ]; then
      "$PY" -m pytest -q -p no:cacheprovider tests/test_readme.py || rc=$?
    else
      echo "tests/test_readme.py on 8 simulated CPU devices:"
      JAX_PLATFORMS=cpu "$PY" -m pytest -q -p no:cacheprovider tests/test_readme.py || rc=$?
    fi
  elif [ "$NGPU" -lt 2 ]; then
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 readme_blocks || rc=$?
  fi
  return $rc
}
export -f readme readme_blocks
want 2 && section "README code blocks" 90 readme

# 3. The GPU tests, in the time left of the 9.5 minutes (less 15 s for the summary, and a minute for section 4 where
#    it runs): four workers a GPU, each allowed 22% of its memory, allocating as they go. On a host of N GPUs the
#    4·N workers (at most one a CPU core) are spread over them, each seeing one GPU (LCE_FLAX_TEST_GPUS, read by
#    tests/conftest.py), so every test runs as on a one-GPU host and the section ends sooner. A run cut short prints
#    what ran and the slowest.
# The client-stack tests (tests/test_integrations_<client>.py) are CPU tests with no gpu mark; where their client is
# not installed (a bare GPU image) pytest could not even import them, so they are left out by name, in the log.
IGNORE=()
for pair in tunix:tunix kauldron:gemma; do  # test file's client : the module it imports
  f=tests/test_integrations_${pair%%:*}.py mod=${pair#*:}
  if [ -f "$f" ] && ! "$PY" -c "import $mod" 2>/dev/null; then
    IGNORE+=("--ignore=$f"); echo "gpu tests: $f left out ($mod is not installed here; it has no gpu tests)"
  fi
done
left=$(( ${GPU_CHECK_SECONDS:-570} - SECONDS - (NGPU >= 2 ? 105 : 15) ))
workers=$(( 4 * NGPU < $(nproc) ? 4 * NGPU : $(nproc) ))
spread=$([ "$NGPU" -ge 2 ] && echo "LCE_FLAX_TEST_GPUS=$NGPU" || echo "LCE_FLAX_TEST_GPUS=")
want 3 && section "gpu tests (pytest -m gpu -n $workers)" "$(( left > 60 ? left : 60 ))" env "$spread" \
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 \
  "$PY" -m pytest -m gpu -n "$workers" -q -rfEs -p no:cacheprovider --durations=15 "${IGNORE[@]}" tests

# 4. Per-device memory of the trainer's data-parallel step (needs 2 GPUs): the fused step at 64 sequences per device
#    compiled on one GPU and on data=2 (benchmarks/trainer_scaling.py --schedule), compared by
#    trainer_scaling.memory_growth. The check holds the bytes alive at once (XLA's live-range peak: what the program
#    and its schedule keep, e.g. every layer's activations while their weight-gradient products wait) to at most
#    1.1x one GPU's; the compiled temporaries' ratio is printed beside it (XLA packs the buffers into one allocation,
#    and on data=2 that allocation has held 6.3 GB more than the buffers alive at any one time, docs/multi_gpu.md).
memory_growth() {
  "$PY" -m benchmarks.trainer_scaling --ks 1,2 --meshes data --heads fused --per-device-batch 64 --repeats 0 \
    --schedule --out "$WORK/memory" >/dev/null || return
  "$PY" - "$WORK/memory/trainer_scaling.json" <<'EOF'
import json, sys
from benchmarks.trainer_scaling import memory_growth
g = memory_growth(json.load(open(sys.argv[1]))["schedule"])
if g["live_ratio"] is None:
  raise SystemExit(f"XLA wrote no live ranges for these compiles (temporaries {g['temp_ratio']:.3f}x)")
for n, b, t, live in zip((1, g["k"]), g["batch_sizes"], g["temp_bytes"], g["live_peak_bytes"]):
  print(f"fused step, {n} GPU(s), {b // n} sequences per device: temporaries {t / 2**30:.2f} GiB, "
        f"most bytes alive at once {live / 2**30:.2f} GiB")
print(f"data={g['k']} / 1 GPU: bytes alive at once {g['live_ratio']:.3f}x (at most 1.1x), "
      f"temporaries {g['temp_ratio']:.3f}x")
raise SystemExit(0 if g["live_ratio"] <= 1.1 else 1)
EOF
}
export -f memory_growth
if ! want 4; then
  :
elif [ "$NGPU" -ge 2 ]; then
  section "trainer step: data=2 vs 1 GPU" 150 memory_growth
else
  echo
  echo "=== trainer step: data=2 vs 1 GPU: not run ($NGPU GPU visible; needs 2)"
fi

echo
echo "=== summary ($(date -u '+%F %T') UTC)"
printf '%s\n' "${SUMMARY[@]}"
if [ "$failed" -ne 0 ]; then echo "GPU CHECK FAILED"
elif [ "$SECTIONS" != " 1 2 3 4 " ]; then echo "GPU CHECK: SECTIONS${SECTIONS}PASSED (not the whole check)"
else echo "GPU CHECK PASSED"; fi
echo "log: $LOG"
exit "$failed"
