"""The backends that run plans, each a plugin of the planner (``planner.backend.BackendPlugin``).

- ``reference``: the numpy reference executor; verifies, never times.
- ``model``: the cost model's estimates as timings; candidates still verified on the reference.
- ``measured``: results timed on another machine (``python -m backends.cupy time``), replayed.
- ``cpu``: generated C kernels, the GEMM library, a native worker pool (``backends.cpu``).
- ``cupy``: generated CUDA kernels and cuBLASLt epilogues through cupy, and the remote runner
  (``backends.cupy``).

``pyproject.toml`` registers them under the ``planner.backends`` entry-point group; they import only the
planner's public surface: ``planner.core``, the interface ``planner.backend`` and the torch evaluator.
"""
