"""The lowerings of mapped torch calls: a typed registry from each kind of ``IMPORTER_TABLE`` (``planner.torch.ops``)
to the function that emits its op-table ops; a lowering returning None keeps the call as a torch-backed step.

Add a mapping by decorating a function ``(importer, node, args, kwargs, concrete) -> value`` with
``@lowering("kind")`` in the module of its theme, and naming its torch callables under that kind in
``IMPORTER_TABLE``. Importing this package registers every lowering.
"""

from planner.torch.lowerings import elementwise, images, indices, products, rows
from planner.torch.lowerings.modules import lower_module
from planner.torch.lowerings.registry import BECOMES, LOWERINGS, lowering

#: the theme modules whose import registered their lowerings
THEMES = (elementwise, images, indices, products, rows)

__all__ = ["BECOMES", "LOWERINGS", "THEMES", "lower_module", "lowering"]
