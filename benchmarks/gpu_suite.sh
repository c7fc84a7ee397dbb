#!/usr/bin/env bash
# One-shot GPU suite (issue 7): GPU tests, C-05 sweep + modes, mlp-epilogue search at 4096^3 fp16 and
# M=16 decode beside torch eager and torch.compile.  Two phases, because egglog is not on the GPU machine:
#
#   bash benchmarks/gpu_suite.sh prepare   # here (CPU, egglog, nvcc): bundles -> benchmarks/gpu_suite/
#                                          # plus a CPU dry run of the device-side runner
#   bash benchmarks/gpu_suite.sh device    # on the H200 (python3 with numpy, cupy, torch, pytest);
#                                          # results and the two markdown reports -> $OUT (or ./out)
#
# nvmath-python (cuBLASLt) is not in the H200 image: carry its wheel in .whl/ (docs/gpu.md).
set -uo pipefail  # no -e: in the device phase a failing step is logged and the rest still runs
cd "$(dirname "$0")/.."
BUNDLES=benchmarks/gpu_suite

prepare() {
  set -e  # preparing is all or nothing: a stale bundle must not travel to the device
  local py=${PYTHON:-.venv/bin/python}
  mkdir -p "$BUNDLES"
  $py -m tests.gpu_bundles  # the GPU tests' bundles (tests/data/gpu), fresh from this checkout
  $py -m fusion_planner bench c05 --mode sweep --export "$BUNDLES/c05_sweep.json"
  $py -m fusion_planner bench c05 --mode modes --export "$BUNDLES/c05_modes.json"
  $py -m fusion_planner export-candidates --example mlp-epilogue --m 4096 --n 4096 --k 4096 --dtype fp16 \
      --device h200 -o "$BUNDLES/mlp_4096.json"
  $py -m fusion_planner export-candidates --example mlp-epilogue --m 16 --n 4096 --k 4096 --dtype fp16 \
      --device h200 -o "$BUNDLES/mlp_decode16.json"
  # dry run of the device side on the CPU: the same runner, numpy executor, decode bundle
  $py -m fusion_planner.backends.cupy time "$BUNDLES/mlp_decode16.json" -o /tmp/gpu_suite_dry_measured.json \
      --executor numpy --warmup 0 --repeats 1 --max-candidates 3
  $py -m fusion_planner.backends.cupy c05 "$BUNDLES/c05_modes.json"
  $py benchmarks/torch_baseline.py "$BUNDLES/mlp_decode16.json" -o /dev/null --check-cpu
  mkdir -p /tmp/gpu_suite_dry && $py benchmarks/gpu_report.py /tmp/gpu_suite_dry
  $py -m pytest -q tests/backends/cupy/test_cupy_gpu.py -p no:cacheprovider
}

device() {
  # $OUT gets at most 8 files back: two logs, two reports and one tarball of every JSON result
  local py=${PYTHON:-python3} out=${OUT:-out} res=${RES:-/tmp/gpu_suite_results}
  mkdir -p "$out" "$res"
  if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  {
    date -u; nvidia-smi -L || true; $py -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
    $py -c "import nvmath; print('nvmath', nvmath.__version__)" || echo "nvmath-python missing: cuBLASLt candidates will be rejected"
  } 2>&1 | tee "$out/suite.log"
  step() {  # one device step on its own: its failure is logged, never the end of the run
    local name=$1; shift
    echo "== $name" | tee -a "$out/suite.log"
    "$@" 2>&1 | tee -a "$out/suite.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "== $name FAILED (exit $rc)" | tee -a "$out/suite.log"
  }
  step "gpu tests" $py -m pytest -q -m gpu tests/backends/cupy/test_cupy_gpu.py -p no:cacheprovider
  step "c05 sweep" $py -m fusion_planner.backends.cupy c05 "$BUNDLES/c05_sweep.json" -o "$res/c05_sweep.json"
  step "c05 modes" $py -m fusion_planner.backends.cupy c05 "$BUNDLES/c05_modes.json" -o "$res/c05_modes.json"
  for shape in mlp_4096 mlp_decode16; do
    step "time $shape" $py -m fusion_planner.backends.cupy time "$BUNDLES/$shape.json" -o "$res/measured_$shape.json" \
      --executor cupy
    step "torch $shape" $py benchmarks/torch_baseline.py "$BUNDLES/$shape.json" -o "$res/torch_$shape.json"
  done
  step "report" $py benchmarks/gpu_report.py "$res"
  cp "$res/c05_h200.md" "$res/mlp_epilogue_h200.md" "$out/" 2>/dev/null || echo "== reports missing" | tee -a "$out/suite.log"
  tar -czf "$out/results.tar.gz" -C "$res" .
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) echo "usage: $0 prepare|device" >&2; exit 2 ;;
esac
