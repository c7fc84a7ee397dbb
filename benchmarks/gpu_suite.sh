#!/usr/bin/env bash
# One-shot GPU suite: smoke checks, GPU tests, calibration, C-05 sweep + modes, mlp-epilogue search at 4096^3
# fp16 and M=16 decode beside torch eager and torch.compile.  Two phases, because egglog is not on the GPU
# machine:
#
#   bash benchmarks/gpu_suite.sh prepare   # here (CPU, egglog, nvcc, network): bundles -> benchmarks/gpu_suite/,
#                                          # the wheels the device lacks -> .whl/, a CPU dry run of the device side
#   bash benchmarks/gpu_suite.sh device    # on the H200 (python3 with numpy, cupy, torch, pytest), with .whl carried;
#                                          # logs, reports and one tarball -> $OUT (or ./out), within 8 minutes:
#                                          # one device call of at most 540 s keeps a 60 s margin
#   ONLY="time heavy|gpu tests" bash benchmarks/gpu_suite.sh device   # only the steps named (a rerun's budget)
#
# docs/gpu.md says what runs, what travels and what comes back.
set -uo pipefail  # no -e: in the device phase a failing step is logged and the rest still runs
cd "$(dirname "$0")/.."
BUNDLES=benchmarks/gpu_suite
WHEELS=${WHEELS:-.whl}  # the carried wheels (prepare writes them)
# The device image (Python 3.12, cupy-cuda13x 14.2, pip CUDA 13 runtime headers) lacks these, exactly so:
# nvmath-python (cuBLASLt) with the cuda-core, cuda-pathfinder and cuda-bindings it was checked with, and
# crt/ (mma.h, for the wmma GEMM kernels) matching the CUDA 13.0 runtime headers.  CI installs the same crt.
# fastjsonschema (pure Python): planner.core checks every file it reads against its declared schema.
DEVICE_WHEELS=(nvmath-python==1.0.0 cuda-core==1.2.2 cuda-pathfinder==1.9.1 cuda-bindings==13.0.3 nvidia-cuda-crt==13.0.88
               fastjsonschema==2.22.2)
DEVICE_PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --abi none
                 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
DEADLINE_S=${DEADLINE_S:-480}  # the device phase ends its last step by then: 540 s per call, less a 60 s margin

wheels() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  $py -m pip download -q --no-deps --only-binary=:all: "${DEVICE_PLATFORM[@]}" -d "$WHEELS" "${DEVICE_WHEELS[@]}"
  ls "$WHEELS"
}

prepare() {
  set -e  # preparing is all or nothing: a stale bundle must not travel to the device
  local py=${PYTHON:-.venv/bin/python}
  mkdir -p "$BUNDLES"
  wheels
  $py -m tests.gpu_bundles  # the GPU tests' bundles (tests/data/gpu), fresh from this checkout
  $py -m planner bench c05 --mode sweep --export "$BUNDLES/c05_sweep.json"
  $py -m planner bench c05 --mode modes --export "$BUNDLES/c05_modes.json"
  $py -m planner export-candidates --example mlp-epilogue --m 4096 --n 4096 --k 4096 --dtype fp16 \
      --device h200 -o "$BUNDLES/mlp_4096.json"
  $py -m planner export-candidates --example mlp-epilogue --m 16 --n 4096 --k 4096 --dtype fp16 \
      --device h200 -o "$BUNDLES/mlp_decode16.json"
  # the planner's own search rows beside the seed's: the heavy example and one fp16 transformer layer
  # (LayerNorm, attention, softmax, GEMMs with epilogues), every exported candidate verified and timed
  $py -m planner export-candidates --example heavy --dtype fp16 --device h200 -o "$BUNDLES/heavy.json"
  $py -m planner export-candidates --example transformer --layers 1 --dtype fp16 --device h200 --top 16 \
      -o "$BUNDLES/transformer_l1.json"
  $py -m planner export-candidates --example transformer --layers 1 --dtype fp16 --seq 1024 --device h200 --top 8 \
      -o "$BUNDLES/transformer_s1024.json"
  # every kernel that travels compiles under cupy's NVRTC options with the device's header layout
  $py -m backends.cupy nvrtc tests/data/gpu/*.json "$BUNDLES"/*.json
  # dry run of the device side on the CPU: the same runner, numpy executor, decode bundle
  $py -m backends.cupy time "$BUNDLES/mlp_decode16.json" -o /tmp/gpu_suite_dry_measured.json \
      --executor numpy --warmup 0 --repeats 1 --max-candidates 3
  $py -m backends.cupy c05 "$BUNDLES/c05_modes.json"
  $py benchmarks/torch_baseline.py "$BUNDLES/mlp_decode16.json" -o /dev/null --check-cpu
  $py benchmarks/torch_baseline.py "$BUNDLES/transformer_l1.json" -o /dev/null --check-cpu
  mkdir -p /tmp/gpu_suite_dry && $py benchmarks/gpu_report.py /tmp/gpu_suite_dry
  $py -m pytest -q tests/backends/cupy/test_cupy_gpu.py -p no:cacheprovider
}

device() {
  # $OUT gets at most 8 files back: the log, the smoke report, three reports, the calibration and one tarball
  local py=${PYTHON:-python3} out=${OUT:-out} res=${RES:-/tmp/gpu_suite_results}
  mkdir -p "$out" "$res"
  {
    date -u
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
      $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && echo "installed $(ls "$WHEELS" | wc -l) carried wheels into /tmp/site" || echo "== wheels FAILED to install"
    else
      echo "== no $WHEELS/*.whl carried (run 'gpu_suite.sh prepare' here and carry $WHEELS): nvmath-python and crt/ missing"
    fi
  } 2>&1 | tee "$out/suite.log"
  # fastjsonschema is the project's own dependency: every step imports it (planner.core reads files through
  # it), so it goes on the base path; the cuda-* wheels stay in /tmp/site, for the steps that need them
  compgen -G "$WHEELS/fastjsonschema-*.whl" >/dev/null && $py -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site-base "$WHEELS"/fastjsonschema-*.whl 2>&1 | tee -a "$out/suite.log"
  export PYTHONPATH=$PWD:/tmp/site-base${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  # the carried wheels (nvmath-python and the cuda-* packages it was checked with, crt/) shadow the image's
  # copies, so only the steps that call cuBLASLt through nvmath or compile the wmma kernels see them; torch
  # (eager and torch.compile) runs on the image's own packages
  local carried=$PYTHONPATH
  [ -d /tmp/site ] && carried=/tmp/site:$PYTHONPATH
  step() {  # one device step on its own, within what is left of the deadline: a failure is logged, never the end
    local name=$1 cap=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ "|$ONLY|" != *"|$name|"* ]]; then echo "== $name not chosen (ONLY)" >>"$out/suite.log"; return; fi
    local left=$((DEADLINE_S - SECONDS))
    if [ "$left" -le 5 ]; then echo "== $name SKIPPED (deadline of ${DEADLINE_S}s reached)" | tee -a "$out/suite.log"; return; fi
    [ "$cap" -lt "$left" ] || cap=$left
    echo "== $name (limit ${cap}s, at ${SECONDS}s)" | tee -a "$out/suite.log"
    timeout "$cap" "$@" 2>&1 | tee -a "$out/suite.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "== $name FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))" | tee -a "$out/suite.log"
  }
  local with_wheels=(env "PYTHONPATH=$carried")  # a prefix timeout can run (it cannot run a shell function)
  # the main tables first: the seed's C-05 program and the planner's rows, then the K4 MLP-epilogue plans at
  # 4096^3 and at decode M=16 beside eager torch and torch.compile; checks and calibration after them
  step "c05 sweep" 60 "${with_wheels[@]}" $py -m backends.cupy c05 "$BUNDLES/c05_sweep.json" -o "$res/c05_sweep.json"
  step "c05 modes" 30 "${with_wheels[@]}" $py -m backends.cupy c05 "$BUNDLES/c05_modes.json" -o "$res/c05_modes.json"
  for shape in mlp_4096 mlp_decode16; do
    step "time $shape" 60 "${with_wheels[@]}" $py -m backends.cupy time "$BUNDLES/$shape.json" -o "$res/measured_$shape.json" \
      --executor cupy
    step "torch $shape" 60 $py benchmarks/torch_baseline.py "$BUNDLES/$shape.json" -o "$res/torch_$shape.json"
  done
  step "time heavy" 40 "${with_wheels[@]}" $py -m backends.cupy time "$BUNDLES/heavy.json" -o "$res/measured_heavy.json" \
    --executor cupy
  for layer in transformer_l1 transformer_s1024; do
    step "time $layer" 90 "${with_wheels[@]}" $py -m backends.cupy time "$BUNDLES/$layer.json" \
      -o "$res/measured_$layer.json" --executor cupy
    step "torch $layer" 90 $py benchmarks/torch_baseline.py "$BUNDLES/$layer.json" -o "$res/torch_$layer.json"
  done
  step "report" 20 $py benchmarks/gpu_report.py "$res"
  step "smoke" 60 "${with_wheels[@]}" $py benchmarks/device_smoke.py --out "$out/smoke.md"
  step "calibrate" 45 "${with_wheels[@]}" $py -m backends.cupy calibrate -o "$out/calibration.json"
  step "gpu tests" 90 "${with_wheels[@]}" $py -m pytest -q -m gpu tests/backends/cupy/test_cupy_gpu.py -p no:cacheprovider
  cp "$res/c05_h200.md" "$res/mlp_epilogue_h200.md" "$res/gpu_search_h200.md" "$out/" 2>/dev/null || echo "== reports missing" | tee -a "$out/suite.log"
  tar -czf "$out/results.tar.gz" -C "$res" .
  echo "== done at ${SECONDS}s" | tee -a "$out/suite.log"
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) echo "usage: $0 prepare|device" >&2; exit 2 ;;
esac
