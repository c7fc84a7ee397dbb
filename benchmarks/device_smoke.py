"""The GPU machine's first half-minute: can everything the suite needs work there?  One PASS/FAIL line a check.

    python benchmarks/device_smoke.py [--out smoke.md]

It prints the versions of cupy, nvmath-python, cuda-core, cuda-bindings, cuda-pathfinder, numpy, NVRTC, the
CUDA runtime and the driver first, then one line per check, with a diagnosis where one fails:

* headers: the include folders cupy hands NVRTC, and ``crt/mma.h`` among them (or carried beside them);
* rawkernel: one generated kernel compiled through ``cupy.RawKernel``, its registers, local memory and the
  driver's occupancy answer;
* elementwise, wmma: a one-kernel elementwise plan and a wmma GEMM + epilogue plan, run and compared with the
  numpy reference;
* timing: CUDA events and CUDA-graph replay of the elementwise plan;
* cublaslt: nvmath-python with each epilogue (DEFAULT, BIAS, RELU, RELU_BIAS, GELU, GELU_BIAS), each checked;
* gelu: cuBLASLt's fp32 GELU against the tanh and the erf forms (max abs error of each);
* runner: the remote runner's verdicts on a small bundle (fp16 elementwise chain);
* bf16: whether cupy holds ``ml_dtypes.bfloat16`` arrays (bf16 cuBLASLt candidates are rejected until it does).

It needs only what the device has (numpy, cupy; nvmath-python for cuBLASLt) and the bundles in
``tests/data/gpu``.  On a machine without a GPU every GPU check fails with its reason and the script still
ends normally; exit 1 whenever a check failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.cupy.bundle import Bundle, Candidate, load_bundle  # noqa: E402
from backends.cupy.runner import measure_candidate, reference_outputs  # noqa: E402
from planner.core.kinds import KernelKind, Verdict  # noqa: E402
from planner.core.ops import CUBLASLT_EPILOGUES, OPS  # noqa: E402
from planner.core.reference import execute_plan  # noqa: E402

DATA = ROOT / "tests" / "data" / "gpu"
PACKAGES = ("cupy-cuda13x", "nvmath-python", "cuda-core", "cuda-bindings", "cuda-pathfinder", "numpy",
            "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-crt")


def versions() -> list[str]:
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} missing")
    try:
        import cupy as cp

        rt = cp.cuda.runtime
        out.append(f"CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
        props = rt.getDeviceProperties(0)
        name = props["name"]
        out.append(f"device {name.decode() if isinstance(name, bytes) else name}, "
                   f"CC {props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs")
    except Exception as exc:
        out.append(f"no CUDA device: {_why(exc)}")
    return out


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:240] if text else ''}"


def _bundle(name: str) -> Bundle:
    return load_bundle(DATA / f"{name}.json")


def _first(bundle: Bundle, keep: Callable[[Candidate], bool]) -> Candidate:
    try:
        return next(c for c in bundle.candidates if keep(c))
    except StopIteration:
        raise RuntimeError(f"bundle {bundle.graph} has no such candidate") from None


def _executor() -> object:
    from backends.cupy.gpu import CupyExecutor

    return CupyExecutor()


def _checked(bundle: Bundle, cand: Candidate, repeats: int = 3) -> dict:
    inputs = bundle.make_inputs()
    entry = measure_candidate(cand, _executor(), inputs, reference_outputs(bundle, inputs), 1, repeats)  # type: ignore[arg-type]
    if entry["verdict"] != Verdict.TIMED:
        raise RuntimeError(f"{cand.plan.notation()} {cand.plan.composition()}: {entry['verdict']}")
    return entry


# ---------------------------------------------------------------- the checks


def check_headers() -> str:
    from backends.cupy import nvrtc

    report = nvrtc.header_report()
    if not report.ok:
        raise RuntimeError(report.describe())
    return f"NVRTC {'.'.join(map(str, nvrtc.nvrtc_version()))}; {report.describe()}"


def check_rawkernel() -> str:
    from backends.cupy import gpu

    cand = _bundle("lean").candidates[0]
    cuda = next(bk.cuda for bk in cand.kernels if bk.cuda is not None)
    kern = gpu.raw_kernel(cuda)
    f = gpu.compiled_facts(kern, cuda.block)
    return f"{cuda.name}: {f['regs']} registers, {f['local_bytes']} B local, {f['occupancy']} blocks/SM at {cuda.block}"


def check_elementwise() -> str:
    b = _bundle("lean")
    e = _checked(b, b.candidates[0])
    return f"{e['plan']} max_abs {e['max_abs']:.3g}, {e['meas_us']:.1f} us"


def check_wmma() -> str:
    b = _bundle("mlp_fp16")
    cand = _first(b, lambda c: [bk.kernel.kind for bk in c.kernels] == [KernelKind.GEMM_EPILOGUE])
    e = _checked(b, cand)
    return f"{e['plan']} {e['composition']} max_abs {e['max_abs']:.3g}, {e['meas_us']:.1f} us"


def check_timing() -> str:
    b = _bundle("lean")
    e = _checked(b, b.candidates[0], repeats=7)
    if e.get("graph_us") is None:
        raise RuntimeError(f"events {e['meas_us']:.1f} us, but the CUDA-graph capture failed (see the log)")
    return f"events median {e['meas_us']:.2f} us over {len(e['samples_us'])}, graph replay {e['graph_us']:.2f} us"


def check_cublaslt() -> str:
    passed, failed = [], []
    for epilogue in CUBLASLT_EPILOGUES:
        b = _bundle(f"lt_{epilogue}")
        try:
            cand = _first(b, lambda c, e=epilogue: c.kernels[0].kernel.epilogue == e)
            e = _checked(b, cand)
            lib = [f for f in e["kernels"] if f.get("kind") == KernelKind.CUBLASLT]
            where = "in place" if lib and all(f.get("preallocated") for f in lib) else "allocating"
            passed.append(f"{epilogue} {e['max_abs']:.2g} ({where})")
        except Exception as exc:
            failed.append(f"{epilogue}: {_why(exc)}")
    if failed:
        raise RuntimeError("; ".join(failed) + (f" (passed: {', '.join(passed)})" if passed else ""))
    return "max_abs " + ", ".join(passed)


def check_gelu() -> str:
    """The library's fp32 GELU against both forms: which it implements, and how closely."""
    from backends.cupy.backend import CupyBackend
    from planner.core.cost import load_device

    b = _bundle("lt_gelu_fp32")
    plan = _first(b, lambda c: c.kernels[0].kernel.epilogue == "GELU_BIAS").plan
    rng = np.random.default_rng(1)
    x, w, bias = (rng.standard_normal(s).astype(np.float32) for s in ((128, 64), (64, 128), (128,)))
    inputs = {"x": x * 0.35, "w": w * 0.35, "b": bias}
    (got,) = CupyBackend(load_device("h200")).compile(plan).run(inputs)
    (tanh_ref,) = execute_plan(plan, inputs, mode="oracle")
    pre = inputs["x"].astype(np.float64) @ inputs["w"] + inputs["b"]
    erf_ref = OPS["GeluErf"].evaluate([pre], {})
    d_tanh, d_erf = float(np.abs(got - tanh_ref).max()), float(np.abs(got - erf_ref).max())
    verdict = f"max abs error vs tanh form {d_tanh:.3g}, vs erf form {d_erf:.3g} (forms differ by {np.abs(tanh_ref - erf_ref).max():.3g})"
    if not d_tanh < d_erf:
        raise RuntimeError("closer to erf than to tanh: " + verdict)
    return verdict


def check_bf16() -> str:
    """Can cupy hold ml_dtypes.bfloat16 arrays (so bf16 cuBLASLt candidates could run through nvmath)?  Today
    they are rejected with that reason; this check says whether the device's cupy would allow more."""
    import cupy as cp
    import ml_dtypes

    host = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    dev = cp.asarray(host)
    back = cp.asnumpy(dev)
    if back.dtype != host.dtype or not np.array_equal(back.astype(np.float32), host.astype(np.float32)):
        raise RuntimeError(f"round trip gave {back.dtype} {back[:4]}")
    return f"cupy holds {dev.dtype} arrays (bf16 cuBLASLt candidates could be enabled)"


def check_runner() -> str:
    from backends.cupy.runner import time_bundle

    result = time_bundle(_bundle("ew_fp16"), _executor(), warmup=0, repeats=1)  # type: ignore[arg-type]
    verdicts = [str(c["verdict"]) for c in result["candidates"]]
    bad = [v for v in verdicts if v != Verdict.TIMED]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(verdicts)} not timed, first: {bad[0]}")
    return f"{len(verdicts)} of {len(verdicts)} candidates verified and timed"


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("headers", check_headers),
    ("rawkernel", check_rawkernel),
    ("elementwise", check_elementwise),
    ("wmma", check_wmma),
    ("timing", check_timing),
    ("cublaslt", check_cublaslt),
    ("gelu", check_gelu),
    ("runner", check_runner),
    ("bf16", check_bf16),
]


def run_checks() -> list[tuple[str, bool, str, float]]:
    rows = []
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            ok, text = True, check()
        except Exception as exc:  # each check's failure is its own line: the rest still run
            ok, text = False, _why(exc)
        rows.append((name, ok, text, time.perf_counter() - t0))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text} ({rows[-1][3]:.1f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the lines as markdown here")
    args = p.parse_args(argv)
    head = versions()
    print("\n".join(head), flush=True)
    rows = run_checks()
    if args.out:
        lines = ["# Device smoke checks", "", *[f"- {v}" for v in head], "",
                 "| check | result | detail | s |", "|---|---|---|---|"]
        lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {t.replace('|', '/')} | {s:.1f} |" for n, ok, t, s in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
