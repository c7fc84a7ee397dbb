"""Convolutional blocks, planned by fusion-planner, against eager torch and torch.compile.

Usage: python benchmarks/cnn_blocks.py [--out docs/results/cnn_blocks.md] [--rounds 11]
                                      [--models basic,bottleneck,stem,small-cnn,mobilenet,efficientnet,convnext,mobilenetv3]
                                      [--dtypes fp32,bf16] [--modes 1,all]

Plain torch modules, random weights and BatchNorm statistics, eval mode, batch 1 (the small CNN: 8): ``basic`` is
ResNet-18's basic block at its first stage (64 channels, 56x56: two 3x3 convolutions with BatchNorm, ReLU and the
residual), ``bottleneck`` ResNet-50's bottleneck at its third stage (1,024 channels squeezed to 256, 14x14: 1x1,
3x3, 1x1), ``stem`` ResNet's stem (7x7 stride-2 convolution of a 224x224 image, BatchNorm, ReLU, 3x3 stride-2 max
pooling), ``small-cnn`` a whole network (a stride-2 stem, max pooling, two basic blocks of 32 channels, global
average pooling and a linear head) on 64x64 images, ``mobilenet`` MobileNetV2's inverted residual at its
56x56 stage (24 channels expanded to 144, a 3x3 depthwise convolution, ReLU6, projected back, the residual),
``efficientnet`` EfficientNet-B0's MBConv at its 28x28 stage (40 channels expanded to 240, a 5x5 depthwise
convolution, SiLU, squeeze-and-excitation to 10, projected back, the residual), ``convnext`` ConvNeXt-T's block at
its first stage (96 channels, 56x56: a 7x7 depthwise convolution, channels moved last, LayerNorm, an MLP of 384
with GELU, channels moved back, the residual), ``mobilenetv3`` MobileNetV3-Large's stem and first eight blocks
on a 224x224 image (hardswish, hard-sigmoid squeeze-and-excitation, stride-2 depthwise convolutions, widths of
16-240 channels, most no multiple of 32).  Per thread mode and dtype a child process (``1``: one thread
pinned to one core; ``all``: every core; the environment of ``cpu_peers.py``) plans the model with
``planner.plan(..., backend="cpu")``, checks the planned call against eager torch within the dtype's tolerance,
then times eager, torch.compile (inductor) and the planned call in interleaved rounds (three calls each, the order
rotating); a figure is the median in µs.  The report lists how many kernels of the plan are Opaque torch calls.
"""

from __future__ import annotations

from typing import Any

from against_torch import main

MODELS = ("basic", "bottleneck", "stem", "small-cnn", "mobilenet", "efficientnet", "convnext", "mobilenetv3")


def build_model(name: str, dtype: str) -> tuple[Any, Any]:
    """(module, its input) for one model, eval mode, BatchNorm statistics drawn at random."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(y)) + x)

    class Bottleneck(nn.Module):
        def __init__(self, c: int, mid: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
            self.conv3, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.bn1(self.conv1(x)))
            y = F.relu(self.bn2(self.conv2(y)))
            return F.relu(self.bn3(self.conv3(y)) + x)

    class Stem(nn.Module):
        def __init__(self, c: int, kernel: int) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, c, kernel, stride=2, padding=kernel // 2, bias=False), nn.BatchNorm2d(c)
            self.pool = nn.MaxPool2d(3, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(F.relu(self.bn(self.conv(x))))

    class SmallCnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.blocks = Stem(32, 3), nn.Sequential(Basic(32), Basic(32))
            self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

    class InvertedResidual(nn.Module):
        def __init__(self, c: int, mid: int, kernel: int, squeeze: int = 0) -> None:
            super().__init__()
            self.expand, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.depthwise = nn.Conv2d(mid, mid, kernel, padding=kernel // 2, groups=mid, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.act = nn.SiLU() if squeeze else nn.ReLU6()
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, squeeze, 1), nn.SiLU(),
                                    nn.Conv2d(squeeze, mid, 1), nn.Sigmoid()) if squeeze else None
            self.project, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.act(self.bn2(self.depthwise(self.act(self.bn1(self.expand(x))))))
            if self.se is not None:
                y = y * self.se(y)
            return x + self.bn3(self.project(y))

    class V3Block(nn.Module):
        """MobileNetV3's block: an expansion (none where it would keep the width), a depthwise convolution,
        squeeze-and-excitation with a hard sigmoid, a projection; ReLU or hardswish; the residual where the
        shape stays."""

        def __init__(self, c: int, kernel: int, mid: int, out: int, se: bool, hard: bool, stride: int) -> None:
            super().__init__()
            act = nn.Hardswish if hard else nn.ReLU
            layers: list[nn.Module] = []
            if mid != c:
                layers += [nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), act()]
            layers += [nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False), nn.BatchNorm2d(mid),
                       act()]
            if se:
                squeeze = max(8, (mid // 4 + 4) // 8 * 8)  # torchvision's _make_divisible(mid // 4, 8)
                squeeze += 8 if squeeze < 0.9 * (mid // 4) else 0
                self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, squeeze, 1), nn.ReLU(),
                                        nn.Conv2d(squeeze, mid, 1), nn.Hardsigmoid())
            self.body, self.has_se = nn.Sequential(*layers), se
            self.project = nn.Sequential(nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out))
            self.residual = stride == 1 and c == out

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.body(x)
            if self.has_se:
                y = y * self.se(y)
            y = self.project(y)
            return x + y if self.residual else y

    class MobileNetV3(nn.Module):
        """MobileNetV3-Large's stem and its first eight blocks (to 80 channels at 14x14)."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
            rows = [(16, 3, 16, 16, False, False, 1), (16, 3, 64, 24, False, False, 2),
                    (24, 3, 72, 24, False, False, 1), (24, 5, 72, 40, True, False, 2), (40, 5, 120, 40, True, False, 1),
                    (40, 5, 120, 40, True, False, 1), (40, 3, 240, 80, False, True, 2), (80, 3, 200, 80, False, True, 1)]
            self.blocks = nn.Sequential(*(V3Block(*row) for row in rows))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(self.stem(x))

    class ConvNeXt(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.depthwise, self.norm = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c, eps=1e-6)
            self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm(self.depthwise(x).permute(0, 2, 3, 1))
            return x + self.down(F.gelu(self.up(y))).permute(0, 3, 1, 2)

    torch.manual_seed(0)
    model, shape = {
        "basic": (lambda: Basic(64), (1, 64, 56, 56)),
        "bottleneck": (lambda: Bottleneck(1024, 256), (1, 1024, 14, 14)),
        "stem": (lambda: Stem(64, 7), (1, 3, 224, 224)),
        "small-cnn": (SmallCnn, (8, 3, 64, 64)),
        "mobilenet": (lambda: InvertedResidual(24, 144, 3), (1, 24, 56, 56)),
        "efficientnet": (lambda: InvertedResidual(40, 240, 5, squeeze=10), (1, 40, 28, 28)),
        "convnext": (lambda: ConvNeXt(96), (1, 96, 56, 56)),
        "mobilenetv3": (MobileNetV3, (1, 3, 224, 224)),
    }.get(name, (None, None))
    if model is None:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    module = model()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return module.eval().to(kind), torch.randn(*shape, dtype=kind)


if __name__ == "__main__":
    main(__doc__, build_model, MODELS, "Convolutional blocks", "model", __file__)
