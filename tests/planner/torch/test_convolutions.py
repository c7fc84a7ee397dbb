"""Convolutional models plan with no Opaque node and equal eager torch: a ResNet basic block and a bottleneck
block (eval mode: BatchNorm folded into the convolutions), a small CNN end to end (stem, max pooling, blocks,
global average pooling, linear head), 1-D convolutions; in fp32 and bf16, on the CPU backend, whose GEMMs over
Im2col patches run as oneDNN's convolutions (or Winograd's, for 3x3 ones of stride 1)."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from backends.cpu import gemm  # noqa: E402
from planner.api import allclose_report  # noqa: E402
from planner.torch.importer import TORCH_DTYPES, import_module  # noqa: E402


class Basic(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


class Bottleneck(nn.Module):
    def __init__(self, c: int = 32, mid: int = 8) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + x)


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16)
        self.pool, self.block = nn.MaxPool2d(3, 2, 1), Basic(16)
        self.avg, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.avg(self.block(x)), 1))


class Conv1dBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(8, 16, 5, padding=2), nn.Conv1d(16, 16, 3, stride=2, dilation=2)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.norm(self.conv2(F.gelu(self.conv1(x)))).mean(-1)


class Activations(nn.Module):
    """The piecewise-linear activations of MobileNet and YOLO after convolutions: ReLU6 (a hardtanh),
    hardswish, leaky ReLU, hardsigmoid, a one-sided clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.conv3 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.act1, self.act2 = nn.ReLU6(inplace=True), nn.Hardswish()

    def forward(self, x):
        y = self.act1(self.bn1(self.conv1(x)))
        y = F.leaky_relu(self.act2(self.conv2(y)), 0.1)
        return torch.clamp(self.conv3(y), min=-0.5) * F.hardsigmoid(x)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1x1 expansion, a 3x3 depthwise convolution (groups = channels), a 1x1 projection,
    each with BatchNorm, ReLU6 after the first two, the residual."""

    def __init__(self, c: int = 8, expand: int = 4, kernel: int = 3) -> None:
        super().__init__()
        mid = c * expand
        self.expand, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.depthwise = nn.Conv2d(mid, mid, kernel, padding=kernel // 2, groups=mid, bias=False)
        self.bn2, self.act = nn.BatchNorm2d(mid), nn.ReLU6(inplace=True)
        self.project, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.act(self.bn1(self.expand(x)))
        y = self.act(self.bn2(self.depthwise(y)))
        return x + self.bn3(self.project(y))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a 7x7 depthwise convolution, channels moved last (``permute``), LayerNorm, an MLP with
    GELU, channels moved back, the residual."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.up, self.down = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.down(F.gelu(self.up(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class MBConv(nn.Module):
    """EfficientNet's block: a 1x1 expansion, a 5x5 depthwise convolution, SiLU, squeeze-and-excitation (the
    pixels' mean, two 1x1 convolutions, a sigmoid: a weight per image and channel), a 1x1 projection."""

    def __init__(self, c: int = 8, mid: int = 24, squeeze: int = 4) -> None:
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.depthwise, self.bn2 = nn.Conv2d(mid, mid, 5, padding=2, groups=mid, bias=False), nn.BatchNorm2d(mid)
        self.reduce, self.restore = nn.Conv2d(mid, squeeze, 1), nn.Conv2d(squeeze, mid, 1)
        self.project, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.silu(self.bn1(self.expand(x)))
        y = F.silu(self.bn2(self.depthwise(y)))
        y = y * torch.sigmoid(self.restore(F.silu(self.reduce(F.adaptive_avg_pool2d(y, 1)))))
        return x + self.bn3(self.project(y))


class AveragedShortcut(nn.Module):
    """ResNet-D's downsampling shortcut (a 2x2 average pooling, then a 1x1 convolution with BatchNorm) beside a
    strided 3x3 convolution, and a 3x3 average pooling whose padding is left out of the divisor."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c)
        self.shortcut = nn.Sequential(nn.AvgPool2d(2, 2), nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c))
        self.smooth = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x):
        return self.smooth(F.relu(self.bn(self.conv(x)) + self.shortcut(x)))


class HardBlocks(nn.Module):
    """Two of MobileNetV3's blocks: hardswish, a stride-2 depthwise convolution, squeeze-and-excitation with ReLU
    and a hard sigmoid, then a block with the residual; 36 and 20 channels, no multiple of 16."""

    def __init__(self, c: int = 12, mid: int = 36, out: int = 20) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(mid, mid, 3, 2, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                                       nn.Hardswish())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, 8, 1), nn.ReLU(), nn.Conv2d(8, mid, 1),
                                nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out))
        self.second = nn.Sequential(nn.Conv2d(out, out, 5, padding=2, groups=out, bias=False), nn.BatchNorm2d(out),
                                    nn.ReLU(), nn.Conv2d(out, out, 1, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        y = self.project(y * self.se(y))
        return y + self.second(y)


MODELS = {
    "activations": (Activations, (2, 8, 6, 6)),
    "hard-blocks": (HardBlocks, (2, 12, 11, 9)),
    "avg-shortcut": (AveragedShortcut, (2, 8, 10, 8)),
    "mbconv": (MBConv, (2, 8, 7, 9)),
    "convnext": (ConvNeXtBlock, (2, 16, 9, 10)),
    "inverted-residual": (InvertedResidual, (2, 8, 9, 7)),
    "basic": (Basic, (2, 16, 8, 8)),
    "bottleneck": (Bottleneck, (2, 32, 7, 7)),
    "small-cnn": (SmallCnn, (2, 3, 32, 32)),
    "conv1d": (Conv1dBlock, (2, 8, 20)),
}


def _example(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    module = factory()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_()
                m.bias.normal_()
    return module.eval().to(dtype), torch.randn(*shape, dtype=dtype)


def _close(got, want) -> None:
    ok, max_abs, max_rel = allclose_report(got.float().numpy(), want.float().numpy(), TORCH_DTYPES[want.dtype])
    assert ok, (max_abs, max_rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_plans_with_no_opaque_node_and_equals_eager(name: str, dtype: torch.dtype) -> None:
    module, x = _example(name, dtype)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert "Opaque" not in ops and ops["MatMul"] >= 2
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=3)
    with torch.no_grad():
        _close(result(x), module(x))
        other = torch.randn_like(x)
        _close(result(other), module(other))


def test_batch_norm_after_a_convolution_is_folded_into_its_weight_and_bias() -> None:
    """Each eval BatchNorm right after a convolution is in the convolution's weight and bias (no scale or shift
    op is left); the block is two Im2col + GEMM pairs, the bias, ReLU and residual their epilogues; the
    activations stay channels last between them (one conversion in, one out)."""
    module, x = _example("basic")
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops == Counter({"ChannelsLast": 1, "Im2col": 2, "MatMul": 2, "BiasAdd": 2, "Relu": 2, "Add": 1,
                           "ChannelsFirst": 1})
    candidates = planner.plan(module, (x,), backend="reference", cache=False).candidates
    fused = [[k.describe() for k in p.kernels] for p in candidates.plans]
    assert any(sum("MatMul+BiasAdd" in d for d in ks) == 2 and any("MatMul+BiasAdd+Add+Relu" in d for d in ks)
               for ks in fused), fused[:3]


def test_the_cpu_backend_convolves_instead_of_storing_the_patches() -> None:
    from backends.cpu.backend import CpuBackend
    from planner.core.cost import load_device
    from planner.core.reference import execute_plan, random_inputs

    module, x = _example("basic")
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    compiled = CpuBackend(load_device("h200"), threads=1).compile(result.plan)
    impls = [s.facts.get("impl") for s in compiled.steps]
    assert impls.count("none: read as a convolution") == 2
    assert sum(str(i).startswith(("onednn-fp32-conv", "torch-fp32-conv")) for i in impls) == 2
    inputs = random_inputs(result.graph, seed=1)
    got, want = compiled.run(inputs)[0], execute_plan(result.plan, inputs)[0]
    assert abs(got - want).max() < 1e-4


def test_a_standalone_batch_norm_is_a_per_channel_scale_and_shift() -> None:
    class NormFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.conv = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.conv(F.relu(self.bn(x)))

    torch.manual_seed(0)
    module, x = NormFirst().eval(), torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        module.bn.running_var.uniform_(0.5, 2.0)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["BiasMul"] == 1 and ops["BiasAdd"] == 2 and "Opaque" not in ops
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    with torch.no_grad():
        _close(result(x), module(x))


def test_a_write_to_batch_norm_statistics_plans_again() -> None:
    """The running statistics are folded into the convolution at import: writing them (a checkpoint loaded
    after planning) is a change of the module, planned again; never the old numbers."""
    module, x = _example("basic")
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    with torch.no_grad():
        module.bn2.running_var.mul_(3.0)
        module.conv1.weight.data.normal_()
        _close(result(x), module(x))
    assert any(action == "plans again" for _, action in result.guard.events)


def test_a_depthwise_convolution_is_its_own_op_with_the_batch_norm_folded_in() -> None:
    module, x = _example("inverted-residual")
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["DepthwiseConv"] == 1 and ops["MatMul"] == 2 and ops["Clamp"] == 2 and "BiasMul" not in ops
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=3)
    assert "c-depthwise" in [f.get("impl") for f in result.compiled.kernel_facts]


def test_squeeze_and_excitation_weights_scale_each_images_pixels_channels_last() -> None:
    """The weight per image and channel multiplies the channels-last rows (PixelMul): no conversion to torch's
    order and back between the convolutions (one ChannelsLast in, one ChannelsFirst out)."""
    module, x = _example("mbconv")
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["PixelMul"] == 1 and ops["ChannelsLast"] == 1 and ops["ChannelsFirst"] == 1 and "Opaque" not in ops


def test_channels_moved_last_and_back_are_the_rows_themselves() -> None:
    """ConvNeXt's permutes copy nothing: the depthwise convolution's channels-last rows are what LayerNorm and the
    MLP read, and the second permute makes the MLP's rows an image batch again for the residual."""
    module, x = _example("convnext")
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["ChannelsLast"] == 1 and ops["ChannelsFirst"] == 1 and "Opaque" not in ops


def test_what_the_lowerings_do_not_take_stays_torch_and_still_equals_eager() -> None:
    """Grouped convolutions other than depthwise ones (ResNeXt's groups of channels, a depthwise one with a
    channel multiplier) and a max pooling whose ceil mode adds a pixel run as torch calls."""

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.multiplied = nn.Conv2d(8, 16, 3, padding=1, groups=8)
            self.pool = nn.MaxPool2d(2, 2, ceil_mode=True)

        def forward(self, x):
            return self.pool(self.multiplied(self.grouped(x)))

    torch.manual_seed(0)
    module, x = Other().eval(), torch.randn(1, 8, 7, 7)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["Opaque"] >= 1
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    with torch.no_grad():
        _close(result(x), module(x))


class ConvThen(nn.Module):
    def __init__(self, activation) -> None:
        super().__init__()
        self.conv, self.activation = nn.Conv2d(8, 16, 3, padding=1), activation

    def forward(self, x):
        return self.activation(self.conv(x))


#: an activation after a 3x3 convolution -> the op it becomes and oneDNN's post-op (None: the C epilogue runs it)
POST_OPS = {
    "relu6": (nn.ReLU6(), "Clamp", "hardtanh"),
    "hardswish": (nn.Hardswish(), "Hardswish", "hardswish"),
    "leaky": (nn.LeakyReLU(0.2), "LeakyRelu", "leaky_relu"),
    "hardsigmoid": (nn.Hardsigmoid(), "Hardsigmoid", "hardsigmoid"),
    "silu": (nn.SiLU(), "Silu", "swish"),
    "clamp-min": (lambda y: torch.clamp(y, min=-0.5), "Clamp", None),
}


@pytest.mark.parametrize("name", list(POST_OPS))
def test_an_activation_after_a_convolution_is_one_of_onednns_post_ops(name: str) -> None:
    """A convolution kernel ending in an activation oneDNN applies (hardtanh for a two-sided clamp, leaky ReLU,
    hardswish, hardsigmoid, swish) runs as one oneDNN convolution with that post-op; a one-sided clamp as the
    convolution and the generated epilogue. Both equal the reference."""
    from backends.codegen import find_matmul
    from backends.cpu.backend import CpuBackend
    from backends.cpu.steps import conv_post_ops
    from planner.core.cost import load_device
    from planner.core.reference import execute_plan, random_inputs

    activation, op, post_op = POST_OPS[name]
    torch.manual_seed(0)
    module, x = ConvThen(activation).eval(), torch.randn(2, 8, 6, 6)
    result = planner.plan(module, (x,), backend="reference", cache=False)
    fused = f"[MatMul+BiasAdd+{op}]"
    plans = [p for p in result.candidates.plans if any(k.describe().endswith(fused) for k in p.kernels)]
    assert plans, [[k.describe() for k in p.kernels] for p in result.candidates.plans[:4]]
    (kernel,) = [k for k in plans[0].kernels if k.describe().endswith(fused)]
    post = conv_post_ops(kernel.body, find_matmul(kernel.body))
    assert (post[2].name if post else None) == post_op
    compiled = CpuBackend(load_device("h200"), threads=1).compile(plans[0])
    (impl,) = [s.facts.get("impl") for s in compiled.steps if s.kernel is kernel]
    assert impl == ("onednn-fp32-conv-post-ops" if post_op else "torch-fp32-conv+c-epilogue")
    inputs = random_inputs(result.graph, seed=2)
    got, want = compiled.run(inputs)[0], execute_plan(plans[0], inputs)[0]
    assert abs(got - want).max() < 1e-4


@pytest.mark.parametrize(("dtype", "products"), [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                                  (torch.bfloat16, "widen")], ids=["fp32", "bf16", "bf16-widened"])
@pytest.mark.parametrize("name", ["basic", "small-cnn"])
def test_winograd_convolutions_equal_eager(name: str, dtype: torch.dtype, products: str, monkeypatch) -> None:
    """With Winograd's F(4x4, 3x3) chosen for the 3x3 convolutions of stride 1 (16 channels here), the planned
    module still equals eager torch, on the planning input and another; the stride-2 stem stays oneDNN's where
    torch multiplies the dtype. Where torch would widen a 16-bit product (an AVX2 CPU, or ``widen`` here),
    Winograd's is the convolution whatever the choice says (oneDNN's is not one)."""
    monkeypatch.setenv("FUSION_PLANNER_CPU_CONVOLUTION", "winograd" if products == "auto" else "onednn")
    monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", products)
    module, x = _example(name, dtype)
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=3)
    impls = [str(f.get("impl")) for f in result.compiled.kernel_facts]
    stored = TORCH_DTYPES[dtype]
    assert impls.count(f"winograd-f4x4-{stored}-conv+c-epilogue") == 2, impls
    stem_onednn = name == "small-cnn" and (stored == "fp32" or gemm.native_16bit(stored))  # not on an AVX2 CPU
    assert sum(i.startswith(f"onednn-{stored}-conv") for i in impls) == stem_onednn, impls
    with torch.no_grad():
        _close(result(x), module(x))
        other = torch.randn_like(x)
        _close(result(other), module(other))
