"""Lowerings of convolutional layers: ``conv2d``/``conv1d`` (with an eval-mode BatchNorm right after folded into
the weight and bias), BatchNorm, max and adaptive average pooling, on image batches stored channels last.

An image batch (N, C, *pixels) is stored as (N*pixels, C) rows (``walk.CHANNELS_LAST``): a convolution is the
op table's ``Im2col`` of its window then a GEMM against the weight as (kh*kw*C, O), so the GEMM's epilogues
(bias, ReLU, a residual add) apply, and a per-channel vector (BatchNorm's scale and shift) is a row vector.
The weight is rearranged (and the BatchNorm folded in) once at import: values computed from parameters, which
the planned module guards (a write to one plans again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import fx

from planner.core.shapes import window_out
from planner.torch.binding import TORCH_DTYPES
from planner.torch.lowerings.registry import lowering
from planner.torch.ops import IMPORTER_TABLE
from planner.torch.walk import CHANNELS_LAST, Importer, Traced

#: the window attributes of a 1-D op, as a 2-D one of height 1
_NO_ROWS = {"kh": 1, "sh": 1, "ph": 0, "dh": 1}


def _pair(v: Any, rank: int) -> tuple[int, ...] | None:
    """An int or a list of ``rank`` ints as ``rank`` ints (torch's int-or-tuple arguments)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * rank
    if isinstance(v, (list, tuple)) and len(v) in (1, rank) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v) * (rank // len(v))
    return None


def _argument(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return kwargs.get(name, args[i] if len(args) > i else default)


def _state(imp: Importer, node: fx.Node, i: int, name: str) -> tuple[torch.Tensor | None, str | None, bool]:
    """(the tensor at argument ``i``/``name``, its parameter or buffer key, whether it is one the plan may
    compute from at import: a parameter, buffer or constant, not a call input)."""
    a = node.kwargs.get(name, node.args[i] if len(node.args) > i else None)
    if a is None:
        return None, None, True
    value = imp.values.get(a) if isinstance(a, fx.Node) else a
    held = imp.env.get(a) if isinstance(a, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None, None, False
    if isinstance(held, Traced):
        state = held.source is not None and held.source[0] == "state" and not held.runtime
        return value, str(held.source[1]) if state and held.source else None, state
    return value, None, not isinstance(held, Traced)


def _window(x: Traced, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
            dilation: tuple[int, ...]) -> dict[str, int]:
    """The op table's window attributes (``core.shapes.WINDOW``) over ``x``'s pixels."""
    if len(kernel) == 1:
        return {"height": 1, "width": x.shape[2], **_NO_ROWS, "kw": kernel[0], "sw": stride[0], "pw": padding[0],
                "dw": dilation[0]}
    return {"height": x.shape[2], "width": x.shape[3], "kh": kernel[0], "kw": kernel[1], "sh": stride[0],
            "sw": stride[1], "ph": padding[0], "pw": padding[1], "dh": dilation[0], "dw": dilation[1]}


def _image(x: Any, concrete: Any) -> TypeGuard[Traced]:
    """Is ``x`` an image batch (N, C, *pixels, one or two of them) the planned ops compute, ``concrete`` its
    result of its dtype?"""
    return (isinstance(x, Traced) and x.runtime and x.dtype in TORCH_DTYPES and len(x.shape) in (3, 4)
            and isinstance(concrete, torch.Tensor) and concrete.dtype == x.dtype)


# ---------------------------------------------------------------- BatchNorm, eval mode


def _batch_norm_args(imp: Importer, node: fx.Node) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """(scale, shift, the state keys they come from) of an eval-mode batch norm call, one value per channel:
    x * scale + shift; None for one in training mode or with running statistics the plan cannot hold."""
    functional = node.target in (F.batch_norm,)
    order = (("running_mean", 1), ("running_var", 2), ("weight", 3), ("bias", 4), ("training", 5), ("eps", 7)) \
        if functional else (("weight", 1), ("bias", 2), ("running_mean", 3), ("running_var", 4), ("training", 5),
                            ("eps", 7))
    found: dict[str, Any] = {}
    keys: list[str] = []
    for name, i in order:
        if name in ("training", "eps"):
            found[name] = node.kwargs.get(name, node.args[i] if len(node.args) > i else (False if name == "training" else 1e-5))
            continue
        t, key, constant = _state(imp, node, i, name)
        if not constant or (t is None and name.startswith("running")):
            return None
        found[name] = t
        keys += [key] if key else []
    if found["training"] is not False or not isinstance(found["eps"], float):
        return None
    var, mean = found["running_var"].double(), found["running_mean"].double()
    scale = torch.rsqrt(var + found["eps"])
    if found["weight"] is not None:
        scale = scale * found["weight"].double()
    shift = -mean * scale
    if found["bias"] is not None:
        shift = shift + found["bias"].double()
    return scale, shift, keys


def _is_batch_norm(node: fx.Node) -> bool:
    return IMPORTER_TABLE.get(node.target) == "batch_norm" and node.op == "call_function"


@lowering("batch_norm", becomes="BiasMul, BiasAdd per channel on channels-last rows (eval mode; folded into a "
                                "convolution right before it)")
def lower_batch_norm(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if not (isinstance(x, Traced) and x.runtime and x.dtype in TORCH_DTYPES and len(x.shape) >= 2):
        return None
    folded = _batch_norm_args(imp, node)
    if folded is None:
        return None
    scale, shift, keys = folded
    imp.folded_from.update(keys)
    rows = imp.channels_last(x, node.name) if len(x.shape) > 2 else imp.use(x, node.name)
    layout = CHANNELS_LAST if len(x.shape) > 2 else ""
    s = imp.use(scale.to(x.dtype), f"{node.name}_scale")
    t = imp.use(shift.to(x.dtype), f"{node.name}_shift")
    scaled = imp.emit(node, "BiasMul", [rows, s], None, x.shape, x.dtype, "_scale", layout=layout)
    assert scaled.id is not None
    return imp.emit(node, "BiasAdd", [scaled.id, t], None, x.shape, x.dtype, layout=layout)


# ---------------------------------------------------------------- convolutions


def _conv_geometry(args: Sequence[Any], kwargs: dict[str, Any], kernel: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    rank = len(kernel)
    stride = _pair(_argument(args, kwargs, 3, "stride", 1), rank)
    dilation = _pair(_argument(args, kwargs, 5, "dilation", 1), rank)
    padding_arg = _argument(args, kwargs, 4, "padding", 0)
    if stride is None or dilation is None:
        return None
    if padding_arg == "valid":
        padding: tuple[int, ...] | None = (0,) * rank
    elif padding_arg == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        padding = tuple(t // 2 for t in totals) if all(t % 2 == 0 for t in totals) and set(stride) == {1} else None
    else:
        padding = _pair(padding_arg, rank)
    return None if padding is None else (stride, padding, dilation)


@lowering("conv", becomes="Im2col then MatMul (a 1x1 convolution: MatMul alone), BiasAdd, on channels-last rows; "
                          "DepthwiseConv, BiasAdd where groups = channels; an eval-mode batch norm right after "
                          "folded into the weight and bias")
def lower_conv(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``conv2d``/``conv1d`` of a computed or input image batch with a weight (and bias) the plan may hold,
    groups 1 (the weight as (kh*kw*C, O) rows) or depthwise (groups = in = out channels: the weight as (kh*kw, C)
    rows), a following eval BatchNorm (its only reader) folded into it."""
    x = args[0] if args else None
    weight, wkey, w_ok = _state(imp, node, 1, "weight")
    bias, bkey, b_ok = _state(imp, node, 2, "bias")
    groups = _argument(args, kwargs, 6, "groups", 1)
    if not (_image(x, concrete) and weight is not None and w_ok and b_ok
            and weight.dim() == len(x.shape) and weight.dtype == x.dtype):
        return None
    depthwise = groups != 1 and groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1
    if groups != 1 and not depthwise:
        return None
    geometry = _conv_geometry(args, kwargs, tuple(weight.shape[2:]))
    if geometry is None:
        return None
    stride, padding, dilation = geometry
    w, b = weight.detach().double(), None if bias is None else bias.detach().double()
    keys = [k for k in (wkey, bkey) if k]
    users = list(node.users)
    folded = _batch_norm_args(imp, users[0]) if len(users) == 1 and _is_batch_norm(users[0]) \
        and users[0].args[0] is node else None
    if folded is not None:
        scale, shift, bn_keys = folded
        w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
        b = shift if b is None else b * scale + shift
        keys += bn_keys
    imp.folded_from.update(keys)
    out_channels, in_channels = w.shape[:2]
    taps = math.prod(w.shape[2:])
    matrix = w.permute(*range(2, w.dim()), 1, 0).reshape(taps * in_channels, out_channels).to(x.dtype).contiguous()
    window = _window(x, tuple(w.shape[2:]), stride, padding, dilation)
    if not _fits(window, concrete):
        return None
    rows = imp.channels_last(x, node.name)
    suffix = "_mm" if b is not None else ""
    if depthwise:  # (taps, 1, C) as (taps, C): each channel's taps in a column
        out = imp.emit(node, "DepthwiseConv", [rows, imp.use(matrix.reshape(taps, out_channels), f"{node.name}_weight")],
                       window, concrete.shape, x.dtype, suffix, layout=CHANNELS_LAST)
    else:
        if taps != 1 or set(stride) != {1} or set(padding) != {0}:
            patches = imp.emit(node, "Im2col", [rows], window, concrete.shape, x.dtype, "_im2col")
            assert patches.id is not None
            rows = patches.id
        out = imp.emit(node, "MatMul", [rows, imp.use(matrix, f"{node.name}_weight")], None, concrete.shape,
                       x.dtype, suffix, layout=CHANNELS_LAST)
    if b is not None:
        assert out.id is not None
        out = imp.emit(node, "BiasAdd", [out.id, imp.use(b.to(x.dtype), f"{node.name}_bias")], None, concrete.shape,
                       x.dtype, layout=CHANNELS_LAST)
    if folded is not None:
        imp.absorbed[users[0]] = out
    return out


# ---------------------------------------------------------------- pooling


def _pool_geometry(args: Sequence[Any], kwargs: dict[str, Any], rank: int) -> tuple[tuple[int, ...] | None, ...]:
    """(kernel, stride, padding) of a max or average pooling call, each None where it is not ``rank`` ints (the
    stride defaults to the kernel, as torch's)."""
    kernel = _pair(_argument(args, kwargs, 1, "kernel_size", None), rank)
    stride_arg = _argument(args, kwargs, 2, "stride", None)
    stride = kernel if stride_arg in (None, [], ()) else _pair(stride_arg, rank)
    return kernel, stride, _pair(_argument(args, kwargs, 3, "padding", 0), rank)


@lowering("max_pool", becomes="MaxPool on channels-last rows (no ceil mode, no indices)")
def lower_max_pool(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if not _image(x, concrete):
        return None
    rank = len(x.shape) - 2
    kernel, stride, padding = _pool_geometry(args, kwargs, rank)
    dilation = _pair(_argument(args, kwargs, 4, "dilation", 1), rank)
    indices = kwargs.get("return_indices", args[6] if len(args) > 6 else False)
    if kernel is None or stride is None or padding is None or dilation is None or indices:
        return None
    window = _window(x, kernel, stride, padding, dilation)
    if not _fits(window, concrete):
        return None  # ceil_mode where it adds a pixel: torch's
    return imp.emit(node, "MaxPool", [imp.channels_last(x, node.name)], window, concrete.shape, x.dtype,
                    layout=CHANNELS_LAST)


@lowering("avg_pool_window", becomes="AvgPool on channels-last rows (count_include_pad, divisor_override; no ceil mode "
                                    "where it adds a pixel)")
def lower_avg_pool(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if not _image(x, concrete):
        return None
    rank = len(x.shape) - 2
    kernel, stride, padding = _pool_geometry(args, kwargs, rank)
    include_pad = _argument(args, kwargs, 5, "count_include_pad", True)
    divisor = _argument(args, kwargs, 6, "divisor_override", None) if rank == 2 else None
    if kernel is None or stride is None or padding is None or not isinstance(include_pad, bool) \
            or not (divisor is None or (isinstance(divisor, int) and divisor > 0)):
        return None
    window = {**_window(x, kernel, stride, padding, (1,) * rank), "include_pad": int(include_pad),
              "divisor": divisor or 0}
    if not _fits(window, concrete):
        return None  # ceil_mode where it adds a pixel: torch's
    return imp.emit(node, "AvgPool", [imp.channels_last(x, node.name)], window, concrete.shape, x.dtype,
                    layout=CHANNELS_LAST)


def _fits(window: dict[str, int], concrete: torch.Tensor) -> bool:
    """Does the window give the result's pixels (torch's floor rule; ceil mode where it changes nothing)?"""
    return window_out(window) == (1,) * (4 - concrete.dim()) + tuple(concrete.shape[2:])


@lowering("avg_pool", becomes="SpatialMean (adaptive average pooling to one pixel)")
def lower_adaptive_avg_pool(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    size = _argument(args, kwargs, 1, "output_size", None)
    if not (_image(x, concrete) and _pair(size, len(x.shape) - 2) == (1,) * (len(x.shape) - 2)):
        return None
    return spatial_mean(imp, node, x, concrete, keep=True)


def spatial_mean(imp: Importer, node: fx.Node, x: Traced, concrete: torch.Tensor, keep: bool) -> Traced:
    """The mean over ``x``'s pixels: (N, C) rows, one pixel per image (channels last, or (N, C) itself)."""
    return imp.emit(node, "SpatialMean", [imp.channels_last(x, node.name)], {"pixels": math.prod(x.shape[2:])},
                    concrete.shape, x.dtype, layout=CHANNELS_LAST if keep else "")


# ---------------------------------------------------------------- channels moved last, and back


@lowering("permute", becomes="no op where it moves an image batch's channels last (N, C, *pixels -> N, *pixels, C: "
                             "its channels-last rows) or back; else torch's")
def lower_permute(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """ConvNeXt's ``x.permute(0, 2, 3, 1)`` of a convolution's result is the rows it is stored as, in torch's
    order; ``permute(0, 3, 1, 2)`` of such rows is the image batch stored channels last again."""
    x = args[0] if args else None
    dims: Any = args[1:] if len(args) > 1 else kwargs.get("dims", ())
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    if not (isinstance(x, Traced) and isinstance(concrete, torch.Tensor) and len(x.shape) in (3, 4)
            and len(dims) == len(x.shape) and all(isinstance(d, int) for d in dims)):
        return None
    rank = len(x.shape)
    order = tuple(d % rank for d in dims)
    if x.layout == CHANNELS_LAST and order == (0, *range(2, rank), 1):
        assert x.id is not None
        return Traced(tuple(concrete.shape), x.dtype, x.runtime, x.id)
    if x.layout == "" and x.runtime and order == (0, rank - 1, *range(1, rank - 1)):
        return Traced(tuple(concrete.shape), x.dtype, x.runtime, imp.use(x, node.name), layout=CHANNELS_LAST)
    return None

