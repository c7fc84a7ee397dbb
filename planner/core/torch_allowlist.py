"""What a file may name: the torch callables, dtypes and formats of torch-backed Opaque calls.

A graph, plan or bundle file is data from elsewhere (docs/security.md).  Its
torch-backed Opaque nodes name torch functions by dotted name; loading such a
file checks every name against the exact sets below before anything is looked
up, imported or called.  There is no attribute walk from data: a name is either
in a set or refused.

* :data:`TORCH_CALLABLES` is everything the torch importer can emit: the call
  targets it maps to op-table ops and those it keeps as Opaque steps
  (``planner.torch.ops.IMPORTER_TABLE`` and ``KEPT_OPAQUE``).  A test checks that
  it equals ``planner.torch.ops.derived_allowlist()``, so adding a target to the
  importer means adding its name here.
* Names a user trusts in addition are added with ``allow_torch_ops`` (Python) or
  ``--allow-torch-op NAME`` (CLI); they must resolve to a torch callable whose
  canonical name is exactly that name.
* An in-process trace of a trusted module may keep any torch op as Opaque; its
  name is usable in this process only.  Saved to a file, such a name is refused
  on load unless the user allows it as above.

This module imports no torch: the remote GPU runner and torch-less machines
check files with it too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from planner.core.ops import OpError

# fmt: off
#: exact qualified names of the torch callables a file may name (see the module docstring)
TORCH_CALLABLES: frozenset[str] = frozenset({
    # convolutional layers: convolutions, batch norm, pooling
    "torch.adaptive_avg_pool1d",
    "torch.avg_pool1d",
    "torch.nn.functional.avg_pool2d",
    "torch.ops.aten.avg_pool1d.default",
    "torch.ops.aten.avg_pool2d.default",
    "torch.batch_norm",
    "torch.max_pool1d",
    "torch.max_pool2d",
    "torch.nn.functional.adaptive_avg_pool2d",
    "torch.nn.functional.batch_norm",
    "torch.nn.functional.max_pool1d",
    "torch.nn.functional.max_pool2d",
    "torch.ops.aten._adaptive_avg_pool2d.default",
    "torch.ops.aten.adaptive_avg_pool1d.default",
    "torch.ops.aten.adaptive_avg_pool2d.default",
    "torch.ops.aten.batch_norm.default",
    "torch.ops.aten.conv1d.default",
    "torch.ops.aten.conv2d.default",
    "torch.ops.aten.max_pool1d.default",
    "torch.ops.aten.max_pool2d.default",
    # the piecewise-linear activations (clamp, clip, hardtanh, relu6, leaky ReLU, hardswish, hardsigmoid)
    "torch.Tensor.clamp_max", "torch.Tensor.clamp_min", "torch.Tensor.clip", "torch.clamp_max", "torch.clamp_min",
    "torch.clip", "torch.nn.functional.hardtanh", "torch.ops.aten.clamp_max.default",
    "torch.ops.aten.clamp_min.default", "torch.ops.aten.hardsigmoid.default", "torch.ops.aten.hardswish.default",
    "torch.ops.aten.hardtanh.default", "torch.ops.aten.leaky_relu.default", "torch.ops.aten.relu6.default",
    "torch.Tensor.abs", "torch.Tensor.add", "torch.Tensor.amax", "torch.Tensor.amin", "torch.Tensor.bfloat16",
    "torch.Tensor.bmm", "torch.Tensor.chunk", "torch.Tensor.clamp", "torch.Tensor.clone", "torch.Tensor.contiguous",
    "torch.Tensor.cos", "torch.Tensor.cumsum", "torch.Tensor.detach", "torch.Tensor.div", "torch.Tensor.erf",
    "torch.Tensor.exp", "torch.Tensor.expand", "torch.Tensor.expand_as", "torch.Tensor.flatten", "torch.Tensor.flip",
    "torch.Tensor.float", "torch.Tensor.gather", "torch.Tensor.half", "torch.Tensor.index_select",
    "torch.Tensor.log", "torch.Tensor.log_softmax", "torch.Tensor.long", "torch.Tensor.masked_fill", "torch.Tensor.matmul", "torch.Tensor.max",
    "torch.Tensor.maximum", "torch.Tensor.mean", "torch.Tensor.min", "torch.Tensor.minimum", "torch.Tensor.mm",
    "torch.Tensor.movedim", "torch.Tensor.mul",
    "torch.Tensor.narrow", "torch.Tensor.neg", "torch.Tensor.permute", "torch.Tensor.pow", "torch.Tensor.reciprocal",
    "torch.Tensor.relu", "torch.Tensor.repeat", "torch.Tensor.reshape", "torch.Tensor.reshape_as", "torch.Tensor.roll",
    "torch.Tensor.rsqrt", "torch.Tensor.select", "torch.Tensor.sigmoid", "torch.Tensor.sin",
    "torch.Tensor.softmax", "torch.Tensor.split", "torch.Tensor.sqrt", "torch.Tensor.square", "torch.Tensor.squeeze",
    "torch.Tensor.std", "torch.Tensor.sub", "torch.Tensor.sum", "torch.Tensor.swapaxes", "torch.Tensor.t",
    "torch.Tensor.tanh", "torch.Tensor.to", "torch.Tensor.transpose", "torch.Tensor.tril", "torch.Tensor.triu",
    "torch.Tensor.type", "torch.Tensor.type_as", "torch.Tensor.unbind", "torch.Tensor.unflatten", "torch.Tensor.unsqueeze",
    "torch.Tensor.var", "torch.Tensor.view", "torch.Tensor.view_as", "torch.Tensor.where",
    "torch.abs", "torch.add", "torch.addmm", "torch.amax", "torch.amin", "torch.baddbmm", "torch.bmm", "torch.cat",
    "torch.chunk", "torch.clamp", "torch.conv1d", "torch.conv2d", "torch.clone", "torch.concat", "torch.concatenate", "torch.cos", "torch.cumsum", "torch.div",
    "torch.dropout", "torch.einsum", "torch.embedding", "torch.erf", "torch.exp", "torch.flatten", "torch.flip",
    "torch.full_like", "torch.gather", "torch.index_select", "torch.layer_norm", "torch.log", "torch.log_softmax",
    "torch.masked_fill", "torch.matmul", "torch.max", "torch.maximum", "torch.mean", "torch.min", "torch.minimum",
    "torch.mm", "torch.movedim", "torch.mul", "torch.narrow", "torch.neg", "torch.ones_like", "torch.outer",
    "torch.permute", "torch.pow", "torch.reciprocal", "torch.relu", "torch.reshape", "torch.roll", "torch.rsqrt",
    "torch.rsub", "torch.select", "torch.sigmoid", "torch.sin", "torch.softmax", "torch.split", "torch.sqrt",
    "torch.square", "torch.squeeze", "torch.stack", "torch.std", "torch.sub", "torch.sum", "torch.swapaxes",
    "torch.t", "torch.tanh", "torch.transpose", "torch.tril", "torch.triu", "torch.unbind", "torch.unsqueeze",
    "torch.var", "torch.where", "torch.zeros_like",
    "torch._C._nn.silu", "torch.nn.functional.dropout",
    "torch.nn.functional.elu", "torch.nn.functional.embedding", "torch.nn.functional.gelu", "torch.nn.functional.glu",
    "torch.nn.functional.group_norm", "torch.nn.functional.hardsigmoid", "torch.nn.functional.hardswish",
    "torch.nn.functional.layer_norm", "torch.nn.functional.leaky_relu", "torch.nn.functional.linear",
    "torch.nn.functional.log_softmax", "torch.nn.functional.mish", "torch.nn.functional.normalize",
    "torch.nn.functional.pad", "torch.nn.functional.relu", "torch.nn.functional.relu6", "torch.nn.functional.rms_norm",
    "torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.sigmoid", "torch.nn.functional.silu",
    "torch.nn.functional.softmax", "torch.nn.functional.softplus", "torch.nn.functional.tanh",
    "torch.operator.add", "torch.operator.floordiv", "torch.operator.getitem", "torch.operator.matmul",
    "torch.operator.mod", "torch.operator.mul", "torch.operator.neg", "torch.operator.pow", "torch.operator.sub",
    "torch.operator.truediv",
    "torch.ops.aten._log_softmax.default", "torch.ops.aten._softmax.default", "torch.ops.aten._to_copy.default",
    "torch.ops.aten._unsafe_view.default", "torch.ops.aten.abs.default", "torch.ops.aten.add.Scalar",
    "torch.ops.aten.add.Tensor", "torch.ops.aten.addmm.default", "torch.ops.aten.alias.default",
    "torch.ops.aten.amax.default", "torch.ops.aten.baddbmm.default", "torch.ops.aten.bmm.default",
    "torch.ops.aten.cat.default", "torch.ops.aten.chunk.default", "torch.ops.aten.clamp.default",
    "torch.ops.aten.clone.default", "torch.ops.aten.cos.default", "torch.ops.aten.detach.default",
    "torch.ops.aten.div.Scalar", "torch.ops.aten.div.Tensor", "torch.ops.aten.div.Tensor_mode",
    "torch.ops.aten.dropout.default", "torch.ops.aten.embedding.default", "torch.ops.aten.erf.default",
    "torch.ops.aten.exp.default", "torch.ops.aten.expand.default", "torch.ops.aten.flatten.using_ints",
    "torch.ops.aten.full_like.default", "torch.ops.aten.gather.default", "torch.ops.aten.gelu.default",
    "torch.ops.aten.index_select.default", "torch.ops.aten.layer_norm.default", "torch.ops.aten.linear.default",
    "torch.ops.aten.log.default", "torch.ops.aten.log_softmax.int", "torch.ops.aten.masked_fill.Scalar",
    "torch.ops.aten.masked_fill.Tensor", "torch.ops.aten.matmul.default", "torch.ops.aten.max.dim",
    "torch.ops.aten.maximum.default", "torch.ops.aten.mean.default", "torch.ops.aten.mean.dim",
    "torch.ops.aten.minimum.default", "torch.ops.aten.mm.default", "torch.ops.aten.mul.Scalar",
    "torch.ops.aten.mul.Tensor", "torch.ops.aten.native_layer_norm.default", "torch.ops.aten.neg.default",
    "torch.ops.aten.ones_like.default", "torch.ops.aten.permute.default", "torch.ops.aten.pow.Tensor_Scalar",
    "torch.ops.aten.pow.Tensor_Tensor", "torch.ops.aten.reciprocal.default", "torch.ops.aten.relu.default",
    "torch.ops.aten.repeat.default", "torch.ops.aten.reshape.default", "torch.ops.aten.rms_norm.default",
    "torch.ops.aten.rsqrt.default", "torch.ops.aten.rsub.Scalar", "torch.ops.aten.scaled_dot_product_attention.default",
    "torch.ops.aten.select.int", "torch.ops.aten.sigmoid.default", "torch.ops.aten.silu.default",
    "torch.ops.aten.sin.default", "torch.ops.aten.slice.Tensor", "torch.ops.aten.softmax.int",
    "torch.ops.aten.split.Tensor", "torch.ops.aten.split_with_sizes.default", "torch.ops.aten.sqrt.default",
    "torch.ops.aten.square.default", "torch.ops.aten.squeeze.default", "torch.ops.aten.squeeze.dim",
    "torch.ops.aten.squeeze.dims", "torch.ops.aten.stack.default", "torch.ops.aten.sub.Scalar",
    "torch.ops.aten.sub.Tensor", "torch.ops.aten.sum.default", "torch.ops.aten.sum.dim_IntList",
    "torch.ops.aten.t.default", "torch.ops.aten.tanh.default", "torch.ops.aten.to.dtype", "torch.ops.aten.type_as.default",
    "torch.ops.aten.transpose.int", "torch.ops.aten.tril.default", "torch.ops.aten.triu.default",
    "torch.ops.aten.unbind.int", "torch.ops.aten.unflatten.int", "torch.ops.aten.unsqueeze.default",
    "torch.ops.aten.var.correction", "torch.ops.aten.var_mean.correction", "torch.ops.aten.view.default",
    "torch.ops.aten.where.self", "torch.ops.aten.zeros_like.default",
})
# fmt: on

#: ``$dtype`` (and ``$tensor`` dtype) tags: torch dtype names without the ``torch.`` prefix
DTYPES: frozenset[str] = frozenset(
    {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
MEMORY_FORMATS: frozenset[str] = frozenset({"contiguous_format", "preserve_format", "channels_last", "channels_last_3d"})
LAYOUTS: frozenset[str] = frozenset({"strided"})

#: limits on one call description (a file cannot make the check itself expensive)
MAX_STEPS = 256
MAX_DEPTH = 32
MAX_VALUES = 200_000
MAX_CONST_ELEMS = 65536
_TAGS = ("$in", "$step", "$tuple", "$dict", "$slice", "$ellipsis", "$dtype", "$device", "$memory_format", "$layout",
         "$tensor")

_user_allowed: set[str] = set()  # allow_torch_ops / --allow-torch-op
_traced: set[str] = set()  # kept by an in-process trace of a trusted module
#: set while a file is loaded: the names it may use besides TORCH_CALLABLES and the user's
_file_allow: ContextVar[frozenset[str] | None] = ContextVar("fusion_planner_file_allow", default=None)


class UnlistedTorchOp(OpError):
    """A file names a torch callable (or dtype, format) outside the allowlist."""


def add_user_allowed(names: Iterable[str]) -> None:
    """Names the user trusts (already checked to resolve canonically by ``planner.torch.ops``)."""
    _user_allowed.update(names)


def add_traced(name: str) -> None:
    _traced.add(name)


def trusted_names() -> list[str]:
    """The names this process trusts beyond the allowlist: the user's additions and the calls of traced modules
    (what a cluster worker is told to trust for the regions it is sent)."""
    return sorted(_user_allowed | _traced)


def is_allowed(name: str) -> bool:
    """May ``name`` be called now?  While a file loads, names kept by in-process traces are not enough."""
    if name in TORCH_CALLABLES or name in _user_allowed:
        return True
    file_allow = _file_allow.get()
    return name in file_allow if file_allow is not None else name in _traced


@contextmanager
def loading_file(allow: Iterable[str] = ()) -> Iterator[None]:
    """Check the torch names of a file being loaded strictly; ``allow`` adds names its caller vouches for
    (the plan cache passes the names of the region it already holds in memory)."""
    token = _file_allow.set(frozenset(allow))
    try:
        yield
    finally:
        _file_allow.reset(token)


def refusal(name: str, what: str = "torch callable") -> UnlistedTorchOp:
    hint = (
        "it was kept from an in-process trace of a trusted module; if you trust this file, allow it with "
        f"--allow-torch-op {name} (CLI) or allow_torch_ops=[{name!r}] (Python)"
        if name in _traced else
        f"it is not on the allowlist (docs/security.md); if you trust this file, allow it with --allow-torch-op {name} "
        f"(CLI) or allow_torch_ops=[{name!r}] (Python)"
    )
    return UnlistedTorchOp(f"names the {what} {name!r}, which is refused: {hint}")


# ---------------------------------------------------------------- the call description


def check_torch_call(impl: str, call_text: Any) -> dict[str, Any]:
    """Validate a torch-backed Opaque node's ``impl`` and ``call`` JSON; returns the parsed call.

    Checks structure, sizes and every name (step functions, dtype, memory-format and
    layout tags) without importing or calling anything.
    """
    if not is_allowed(impl):
        raise refusal(impl)
    if not isinstance(call_text, str):
        raise OpError(f"Opaque[{impl}]: the 'call' attribute must be a JSON string")
    try:
        call = json.loads(call_text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise OpError(f"Opaque[{impl}]: malformed 'call' attribute ({exc})") from None
    if not isinstance(call, dict) or not {"steps", "in", "out"} <= set(call):
        raise OpError(f"Opaque[{impl}]: 'call' must be an object with 'steps', 'in' and 'out'")
    n_in = len(_shape_list(call["in"], f"Opaque[{impl}]: call 'in'"))
    _shape(call["out"], f"Opaque[{impl}]: call 'out'")
    steps = call["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        raise OpError(f"Opaque[{impl}]: 'steps' must be a list of 1 to {MAX_STEPS} calls")
    budget = [MAX_VALUES]
    for j, step in enumerate(steps):
        where = f"Opaque[{impl}] step {j}"
        if not isinstance(step, dict) or not isinstance(step.get("impl"), str):
            raise OpError(f"{where}: must be an object with a string 'impl'")
        if not is_allowed(step["impl"]):
            raise _at(where, refusal(step["impl"]))
        if not isinstance(step.get("args"), list):
            raise OpError(f"{where}: 'args' must be a list")
        kwargs = step.get("kwargs")
        if not (isinstance(kwargs, dict) and set(kwargs) == {"$dict"} and isinstance(kwargs["$dict"], dict)):
            raise OpError(f"{where}: 'kwargs' must be {{\"$dict\": {{...}}}}")
        item = step.get("item", -1)
        if isinstance(item, bool) or not isinstance(item, int) or not -1 <= item < 1024:
            raise OpError(f"{where}: 'item' must be an integer from -1 to 1023")
        if "out" not in step:
            raise OpError(f"{where}: needs its result's shape, 'out'")
        _shape(step["out"], f"{where}: 'out'")
        _shape_list(step.get("shapes", []), f"{where}: 'shapes'")
        for key, value in kwargs["$dict"].items():
            tagged_device = key == "device" and isinstance(value, dict) and set(value) == {"$device"}
            if key in REFUSED_KWARGS and not tagged_device:
                raise OpError(f"{where}: the keyword {key!r} is refused ({REFUSED_KWARGS[key]})")
        _check_value(step["args"], where, n_in, j, 0, budget)
        _check_value(kwargs, where, n_in, j, 0, budget)
    return call


#: keywords a step may not pass, and why
REFUSED_KWARGS = {
    "out": "a step writes its own result; out= would write into memory the planner owns",
    "device": "a step runs on the host; say so with a {\"$device\": ...} tag, not a device name",
}
#: a plain string naming a device a torch-backed step must not reach (its steps run on the host)
_DEVICE_NAME = re.compile(r"(cuda|meta|mps|xla|xpu|hip|hpu|mtia|lazy|vulkan|ipu|privateuseone)(:\d+)?", re.I)


def _at(where: str, exc: UnlistedTorchOp) -> UnlistedTorchOp:
    return UnlistedTorchOp(f"{where} {exc}")


def _shape(s: Any, where: str) -> list[int]:
    if not isinstance(s, list) or len(s) > 16 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s):
        raise OpError(f"{where}: a shape must be a list of at most 16 non-negative integers")
    return s


def _shape_list(v: Any, where: str) -> list[list[int]]:
    if not isinstance(v, list) or len(v) > 4096:
        raise OpError(f"{where}: must be a list of shapes")
    return [_shape(s, where) for s in v]


def _check_value(v: Any, where: str, n_in: int, step: int, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise OpError(f"{where}: the call description has more than {MAX_VALUES} values")
    if depth > MAX_DEPTH:
        raise OpError(f"{where}: arguments nest deeper than {MAX_DEPTH}")
    if isinstance(v, str) and _DEVICE_NAME.fullmatch(v.strip()):
        raise OpError(f"{where}: names the device {v[:20]!r}; a torch-backed step runs on the host")
    if v is None or isinstance(v, (bool, str)):
        return
    if isinstance(v, int):
        if abs(v) >= 2**63:
            raise OpError(f"{where}: integer argument {v} does not fit 64 bits")
        return
    if isinstance(v, float):
        return
    if isinstance(v, list):
        for x in v:
            _check_value(x, where, n_in, step, depth + 1, budget)
        return
    if not isinstance(v, dict) or len(v) != 1:
        raise OpError(f"{where}: an argument object must have exactly one tag of {', '.join(_TAGS)}")
    ((tag, x),) = v.items()
    if tag in ("$in", "$step"):
        bound = n_in if tag == "$in" else step
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < bound:
            raise OpError(f"{where}: {tag} {x!r} is out of range (0..{bound - 1})")
    elif tag in ("$tuple", "$slice"):
        if not isinstance(x, list) or (tag == "$slice" and len(x) != 3):
            raise OpError(f"{where}: {tag} needs a list" + (" of 3" if tag == "$slice" else ""))
        _check_value(x, where, n_in, step, depth + 1, budget)
    elif tag == "$dict":
        if not isinstance(x, dict):
            raise OpError(f"{where}: $dict needs an object")
        for val in x.values():
            _check_value(val, where, n_in, step, depth + 1, budget)
    elif tag == "$dtype":
        _named(x, DTYPES, "dtype", where)
    elif tag == "$memory_format":
        _named(x, MEMORY_FORMATS, "memory format", where)
    elif tag == "$layout":
        _named(x, LAYOUTS, "layout", where)
    elif tag == "$tensor":
        _check_tensor(x, where)
    elif tag == "$device":  # a step runs on the host whatever device it names
        if not isinstance(x, str) or len(x) > 32:
            raise OpError(f"{where}: $device needs a device name")
    elif tag == "$ellipsis":  # the importer writes 0
        if x not in (0, None) or isinstance(x, bool):
            raise OpError(f"{where}: $ellipsis takes 0")
    else:
        raise OpError(f"{where}: unknown tag {tag!r}; known: {', '.join(_TAGS)}")


def _named(x: Any, allowed: frozenset[str], what: str, where: str) -> None:
    if not isinstance(x, str) or x not in allowed:
        raise UnlistedTorchOp(f"{where}: names the {what} {x!r}, which is refused (allowed: {', '.join(sorted(allowed))})")


def _check_tensor(x: Any, where: str) -> None:
    if not isinstance(x, dict) or set(x) != {"dtype", "shape", "data"}:
        raise OpError(f"{where}: $tensor needs exactly 'dtype', 'shape' and 'data'")
    _named(x["dtype"], DTYPES, "dtype", where)
    shape = _shape(x["shape"], f"{where}: $tensor")
    data = x["data"]
    if not isinstance(data, list) or len(data) != math.prod(shape) or len(data) > MAX_CONST_ELEMS:
        raise OpError(f"{where}: $tensor data must be a flat list of prod(shape) <= {MAX_CONST_ELEMS} numbers")
    if not all(isinstance(d, (int, float)) and (isinstance(d, bool) or abs(d) < 2**63) for d in data):
        raise OpError(f"{where}: $tensor data must be numbers")
