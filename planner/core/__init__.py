"""The bottom layer: dtypes, the op table, the opaque registry, the graph IR, plans, the cost model,
tolerances and the output check, the input recipe, regions, plan files and example graphs.

Numpy, scipy and ml_dtypes only: no egglog, torch or cupy (the remote GPU runner imports from here).
Importing the package registers the Opaque op (``opaque``) in the op table.
"""

from planner.core import opaque as _opaque  # noqa: F401  (registers the Opaque op kind)
