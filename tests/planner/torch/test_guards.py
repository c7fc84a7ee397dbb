"""A planned module is never silently wrong: what its plan assumed is guarded, as torch.compile guards, and a
change gives eager torch's answer (a new plan, or eager torch itself), a named refusal, or an error by choice."""

from __future__ import annotations

import threading
import types

import pytest

torch = pytest.importorskip("torch")
import numpy as np  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from planner.torch.binding import Sampler  # noqa: E402
from planner.torch.errors import TorchImportError  # noqa: E402
from planner.torch.guards import MAX_PLANS, GuardError, call_layout  # noqa: E402

FAST = dict(backend="cpu", max_candidates=3, warmup=0, repeats=2)


class Mlp(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32).to(dtype)
        self.ln = nn.LayerNorm(32).to(dtype)
        self.l2 = nn.Linear(32, 16).to(dtype)
        self.scale = 0.5

    def forward(self, x):
        return self.l2(torch.relu(self.ln(self.l1(x)))) * self.scale


def _planned(dtype=torch.float32, **opts):
    torch.manual_seed(0)
    m = Mlp(dtype).eval()
    x = torch.randn(4, 16, dtype=dtype)
    return m, x, planner.plan(m, (x,), **{**FAST, **opts})


def _agrees(result, m, x) -> None:
    with torch.no_grad():
        want = m(x)
    got = result(x)
    tol = 1e-4 if x.dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()) + tol), \
        float((got.float() - want.float()).abs().max())


CHANGES = {
    "a replaced submodule": lambda m: setattr(m, "l1", nn.Linear(16, 32).to(m.l1.weight.dtype)),
    "weight.data set": lambda m: setattr(m.l1.weight, "data", torch.randn_like(m.l1.weight)),
    "weight.data.copy_": lambda m: m.l1.weight.data.copy_(torch.randn_like(m.l1.weight)),
    "weight.data.mul_(0)": lambda m: m.l2.weight.data.mul_(0),
    "a new Parameter": lambda m: setattr(m.l2, "bias", nn.Parameter(torch.randn_like(m.l2.bias))),
    "an attribute": lambda m: setattr(m, "scale", 5.0),
    "a norm's eps": lambda m: setattr(m.ln, "eps", 0.5),
    "train()": lambda m: m.train(),
    "a forward hook": lambda m: m.l1.register_forward_hook(lambda mod, args, out: out * 2),
    "a forward pre-hook": lambda m: m.l2.register_forward_pre_hook(lambda mod, args: (args[0] + 1,)),
    "a forward set on the instance": lambda m: setattr(m.l1, "forward", lambda x: nn.functional.linear(x, m.l1.weight)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_gives_eager_torchs_answer(change, dtype):
    m, x, result = _planned(dtype)
    _agrees(result, m, x)
    CHANGES[change](m)
    _agrees(result, m, x)


class Configured(nn.Module):
    """A module whose forward reads values of objects it holds: a config, a dict of options."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.config = types.SimpleNamespace(scale=2.0, act="relu")
        self.options = {"shift": 1.0}
        self.table = np.arange(3.0)  # compared elementwise by ==: only as itself

    def forward(self, x):
        h = self.l1(x)
        h = torch.relu(h) if self.config.act == "relu" else torch.tanh(h)
        return h * self.config.scale + self.options["shift"]


HELD_CHANGES = {
    "a config value": (lambda m: setattr(m.config, "scale", 3.0), "config.scale was 2.0 when planned, is set to 3.0"),
    "a config choice": (lambda m: setattr(m.config, "act", "tanh"), "config.act was 'relu' when planned"),
    "the config replaced": (lambda m: setattr(m, "config", types.SimpleNamespace(scale=5.0, act="relu")), "config was"),
    "a dict's value": (lambda m: m.options.update(shift=-1.0), "options.shift was 1.0 when planned"),
    "an array replaced": (lambda m: setattr(m, "table", np.arange(3.0)), "table was array"),
}


@pytest.mark.parametrize("change", sorted(HELD_CHANGES))
def test_a_value_in_an_object_a_module_holds_changed_gives_eager_torchs_answer(change):
    torch.manual_seed(0)
    m, x = Configured().eval(), torch.randn(4, 16)
    result = planner.plan(m, (x,), **FAST)
    make, reason = HELD_CHANGES[change]
    make(m)
    _agrees(result, m, x)
    assert reason in result.guard.events[0][0]


def test_a_held_object_set_to_equal_values_keeps_the_plan():
    torch.manual_seed(0)
    m, x = Configured().eval(), torch.randn(4, 16)
    result = planner.plan(m, (x,), **FAST)
    m.config.scale = float("2.0")
    m.config = types.SimpleNamespace(scale=2.0, act="relu")
    _agrees(result, m, x)
    assert not result.guard.events


SCALE = 2.0
ACT = torch.relu
OFFSET = 1.0
UNREAD = 0  # a global no method of the module names


def _shift(h):
    return h + OFFSET


class CodeReads(nn.Module):
    """A module whose forward reads globals (one through a function it calls), a class attribute, a list it holds
    and values two objects deep."""

    factor = 3.0

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.sizes = [1.0, 2.0]
        self.config = types.SimpleNamespace(text=types.SimpleNamespace(scale=2.0, gains=[1.0, 0.5]))

    def forward(self, x):
        h = ACT(self.l1(x)) * SCALE * self.factor * self.sizes[0]
        return _shift(h) * self.config.text.scale * self.config.text.gains[0]


_PLANNED_FORWARD = CodeReads.forward


def _doubled(self, x):
    return _PLANNED_FORWARD(self, x) * 2


CODE_CHANGES = {
    "a global": (lambda m, mp: mp.setitem(globals(), "SCALE", 5.0),
                 "global SCALE (read by CodeReads.forward) was 2.0 when planned, is set to 5.0"),
    "a global function": (lambda m, mp: mp.setitem(globals(), "ACT", torch.tanh), "global ACT"),
    "a global a called function reads": (lambda m, mp: mp.setitem(globals(), "OFFSET", -1.0),
                                         "global OFFSET (read by _shift) was 1.0"),
    "a class attribute": (lambda m, mp: mp.setattr(CodeReads, "factor", 4.0),
                          "CodeReads.factor (of the class) was 3.0 when planned, is set to 4.0"),
    "the forward patched on the class": (lambda m, mp: mp.setattr(CodeReads, "forward", _doubled),
                                         "CodeReads.forward (of the class) was"),
    "torch's forward patched on its class": (
        lambda m, mp: mp.setattr(nn.Linear, "forward", lambda self, x: nn.functional.linear(x, self.weight)),
        "Linear.forward (of the class) was"),
    "a list changed in place": (lambda m, mp: m.sizes.__setitem__(0, 3.0),
                                "sizes was [1.0, 2.0] when planned, is set to [3.0, 2.0]"),
    "a value two objects deep": (lambda m, mp: setattr(m.config.text, "scale", 4.0),
                                 "config.text.scale was 2.0 when planned, is set to 4.0"),
    "a list two objects deep changed in place": (lambda m, mp: m.config.text.gains.append(7.0),
                                                 "config.text.gains was [1.0, 0.5]"),
}


@pytest.mark.parametrize("change", sorted(CODE_CHANGES))
def test_a_change_to_the_code_the_forward_runs_gives_eager_torchs_answer(change, monkeypatch):
    torch.manual_seed(0)
    m, x = CodeReads().eval(), torch.randn(4, 16)
    result = planner.plan(m, (x,), **FAST)
    _agrees(result, m, x)
    make, reason = CODE_CHANGES[change]
    make(m, monkeypatch)
    _agrees(result, m, x)
    assert reason in result.guard.events[0][0]


def _of_no_module(h):
    return h * SCALE


_of_no_module.__module__ = None  # as a function made by exec may be


class CallsOfNoModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return _of_no_module(self.l1(x))


def test_a_function_of_no_module_the_forward_calls_is_followed_to_the_globals_it_reads():
    from planner.torch.guards import ModuleState

    state = ModuleState.record(CallsOfNoModule().eval())
    assert {(where, name) for where, _, name, _ in state.globals_read} >= {
        ("CallsOfNoModule.forward", "_of_no_module"), ("_of_no_module", "SCALE")}


def _closing_over(k: float):
    """A module class whose forward closes over ``k``, and a setter of ``k``."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(16, 16)

        def forward(self, x):
            return self.l1(x) * k

    def set_k(value: float | None) -> None:
        nonlocal k
        if value is None:
            del k
        else:
            k = value

    return Scaled, set_k


def test_a_variable_the_forward_closes_over_changed_gives_eager_torchs_answer():
    torch.manual_seed(0)
    scaled, set_k = _closing_over(2.0)
    m, x = scaled().eval(), torch.randn(4, 16)
    result = planner.plan(m, (x,), **FAST)
    set_k(-3.0)
    _agrees(result, m, x)
    assert "Scaled.forward closes over was 2.0 when planned, is set to -3.0" in result.guard.events[0][0]


def test_a_closed_over_variable_unbound_is_a_change_not_a_crash():
    from planner.torch.guards import ModuleState

    scaled, set_k = _closing_over(2.0)
    state = ModuleState.record(scaled().eval())
    set_k(None)
    assert state.quick is not None and not state.quick.same()
    assert "closes over was 2.0 when planned, is unbound now" in (state.changed() or "")


@pytest.mark.parametrize("tags", [True, False], ids=["dict-versions", "ids"])
def test_the_quick_check_sees_code_changes_and_ignores_globals_the_forward_does_not_read(tags, monkeypatch):
    from planner.torch import guards
    from planner.torch.guards import ModuleState

    if not tags:
        monkeypatch.setattr(guards, "_dict_version", None)
    m = CodeReads().eval()
    state = ModuleState.record(m)
    assert state.quick is not None and state.quick.same()
    for value in range(3):  # a script's loop rebinding its globals: no closer look
        monkeypatch.setitem(globals(), "UNREAD", value)
        assert state.quick.same()
    for name, (make, reason) in sorted(CODE_CHANGES.items()):
        with monkeypatch.context() as mp:
            before = (list(m.sizes), list(m.config.text.gains), m.config.text.scale)
            make(m, mp)
            assert not state.quick.same(), name
            assert reason in (state.changed() or ""), name
            m.sizes[:], m.config.text.gains[:], m.config.text.scale = before
        assert state.changed() is None and state.quick.same(), name


def test_a_global_forward_hook_registered_after_planning_gives_eager_torchs_answer():
    m, x, result = _planned()
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out + 1 if isinstance(mod, nn.Linear) else out)
    try:
        _agrees(result, m, x)
        assert "every module" in result.guard.events[0][0]
    finally:
        handle.remove()
    _agrees(result, m, x)


def test_a_hook_present_when_planning_is_traced_and_its_removal_plans_again():
    torch.manual_seed(0)
    m, x = Mlp().eval(), torch.randn(4, 16)
    handle = m.ln.register_forward_hook(lambda mod, args, out: out * 3)
    result = planner.plan(m, (x,), **FAST)
    _agrees(result, m, x)
    assert not result.guard.events
    handle.remove()
    _agrees(result, m, x)
    assert result.guard.events[0] == ("a forward hook was registered on or removed from ln after planning",
                                      "plans again")


def test_a_hook_elsewhere_keeps_the_plan():
    m, x, result = _planned()
    nn.Linear(2, 2).register_forward_hook(lambda mod, args, out: out * 2)  # no module of the plan's tree
    _agrees(result, m, x)
    assert not result.guard.events and result.guard.state.quick.same()


def test_fx_alone_refuses_a_hooked_module_naming_where_the_hooks_are():
    from planner.torch.importer import import_module

    m = Mlp().eval()
    m.l2.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(TorchImportError, match="forward hooks on l2: torch.fx traces past them"):
        import_module(m, (torch.randn(4, 16),), strategy="fx")


def test_calls_from_two_threads_take_turns_and_each_gets_eager_torchs_answer():
    m, x, result = _planned()
    y = torch.randn_like(x)
    with torch.no_grad():
        want = {id(x): m(x), id(y): m(y)}
    wrong: list[float] = []

    def calls(inp):
        for _ in range(100):
            got = result(inp)
            if not torch.allclose(got, want[id(inp)], rtol=1e-4, atol=1e-5):
                wrong.append(float((got - want[id(inp)]).abs().max()))

    threads = [threading.Thread(target=calls, args=(inp,)) for inp in (x, y)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_a_structural_change_under_eager_runs_the_module_and_says_so():
    m, x, result = _planned(on_change="eager")
    m.scale = 3.0
    _agrees(result, m, x)
    assert result.guard.eager_since and "scale was 0.5" in result.guard.events[-1][0]


def test_a_structural_change_under_error_raises_naming_it():
    m, x, result = _planned(on_change="error")
    m.ln.eps = 0.1
    with pytest.raises(GuardError, match=r"ln\.eps was 1e-05 when planned"):
        result(x)
    m.ln.eps = 1e-5
    handle = m.l1.register_forward_hook(lambda mod, args, out: out)
    with pytest.raises(GuardError, match="a forward hook was registered on or removed from l1"):
        result(x)
    handle.remove()
    with pytest.raises(GuardError, match="inputs"):
        result(torch.randn(8, 16)) if (setattr(m.ln, "eps", 1e-5) or True) else None


def test_new_input_shapes_get_plans_of_their_own_up_to_a_limit_then_eager():
    m, x, result = _planned()
    for rows in range(5, 5 + MAX_PLANS + 2):
        _agrees(result, m, torch.randn(rows, 16))
    plans = result.guard.plans
    assert sum(p is not None for p in plans.values()) == MAX_PLANS and any(p is None for p in plans.values())
    assert any("kept already" in action for _, action in result.guard.events)


#: changes to the very tensor a planned module was last called with, before it is passed again
INPUT_CHANGES = {
    "written in place": lambda x: x.mul_(-2),
    "new memory through .data": lambda x: setattr(x, "data", torch.randn_like(x)),
    "set_ to another storage": lambda x: x.set_(torch.randn(4, 16)),
    "strided in place": lambda x: x.as_strided_((4, 16), (1, 4)),
    "given another shape": lambda x: x.set_(torch.randn(6, 16)),
    "made to need grad": lambda x: x.requires_grad_(),
}


@pytest.mark.parametrize("change", sorted(INPUT_CHANGES))
def test_the_same_input_tensor_changed_between_calls_gives_eager_torchs_answer(change):
    m, x, result = _planned()
    _agrees(result, m, x)
    _agrees(result, m, x)  # the second call reads the layout the first found
    with torch.no_grad():
        INPUT_CHANGES[change](x)
        _agrees(result, m, x)


def test_the_same_input_tensors_again_skip_the_layout_read_and_the_feed(monkeypatch):
    import planner.torch.guards as guards

    m, x, result = _planned()
    result(x)
    reads = []
    monkeypatch.setattr(guards, "call_layout", lambda args: reads.append(args) or call_layout(args))
    fed = result.bound._fed
    _agrees(result, m, x)
    assert reads == [] and result.bound._fed is fed
    _agrees(result, m, x.clone())  # another tensor of the same layout: read again
    assert len(reads) == 1 and result.bound._fed is not fed


def test_a_weight_written_between_the_samples_is_seen_with_exact_weights_or_after_rebind():
    m, x, result = _planned(exact_weights=True)
    with torch.no_grad():
        m.l1.weight.data[3, 5] += 1.0  # one element, through .data: no version bump
    _agrees(result, m, x)
    m2, x2, sampled = _planned()
    with torch.no_grad():
        m2.l1.weight.data[3, 5] += 1.0
    sampled.rebind()
    _agrees(sampled, m2, x2)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return torch.relu(x)


class InPlaceInput(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return torch.relu(x)


class InPlaceView(nn.Module):
    def forward(self, x):
        x.view(-1).add_(1)
        return x * 3


class InPlaceClone(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.add_(1)
        return torch.relu(y)


@pytest.mark.parametrize("module, name", [(Counting(), "count"), (InPlaceInput(), "x"), (InPlaceView(), "x")])
def test_a_write_to_an_input_or_a_buffer_is_refused_at_planning_naming_it(module, name):
    with pytest.raises(TorchImportError, match=rf"writes the module's .*{name!r} in place"):
        planner.plan(module, (torch.randn(4, 8),), backend="reference")


def test_an_in_place_write_to_a_copy_is_planned():
    x = torch.randn(4, 8)
    result = planner.plan(InPlaceClone(), (x,), backend="reference")
    assert torch.equal(result(x), InPlaceClone()(x))


class Aliasing(nn.Module):
    def forward(self, x):
        y = torch.relu(x) + 1.0
        return y, y.view(-1), x, x.view(2, -1)


def test_outputs_that_share_memory_in_eager_torch_share_it_in_the_plan():
    x = torch.randn(4, 8)
    y, flat, same, viewed = planner.plan(Aliasing(), (x,), backend="cpu", max_candidates=2)(x)
    assert flat.data_ptr() == y.data_ptr() and flat.shape == (32,)
    assert same is x and viewed.data_ptr() == x.data_ptr() and viewed.shape == (2, 16)
    assert torch.equal(y, torch.relu(x) + 1.0)


class TransposedAlias(nn.Module):
    def forward(self, x):
        y = torch.relu(x) + 1.0
        return y, y.t()


def test_an_output_that_is_a_transposed_view_of_another_is_refused_naming_it():
    with pytest.raises(TorchImportError, match="strided view"):
        planner.plan(TransposedAlias(), (torch.randn(4, 8),), backend="reference")


def _torch_layout(t):
    return (tuple(t.shape), t.dtype, t.device.type, t.is_contiguous())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 16),
    lambda: torch.randn(16, 4).t(),  # strided
    lambda: torch.randn(4, 1, 16).as_strided((4, 1, 16), (16, 7, 1)),  # a size-1 dim of any stride: contiguous
    lambda: torch.randn(0, 16),
    lambda: torch.randn(3, 8)[:, ::2],
    lambda: torch.tensor(2.0),
])
def test_a_calls_layout_read_through_numpy_is_the_one_torch_reports(make):
    t = make()
    sig, arrays = call_layout((t,))
    assert sig == (_torch_layout(t),) and arrays is not None
    assert t.numel() == 0 or arrays[0].ctypes.data == t.data_ptr()  # its memory, not a copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [
    lambda d: torch.randn(4, 16, dtype=d),
    lambda d: torch.randn(16, 4, dtype=d).t(),
    lambda d: torch.randn(3, 8, dtype=d)[:, ::2],
])
def test_a_16_bit_calls_layout_and_bits_read_through_numpy_are_torchs(make, dtype):
    t = make(dtype)
    sig, arrays = call_layout((t,))
    assert sig == (_torch_layout(t),) and arrays is not None
    assert arrays[0].ctypes.data == t.data_ptr() and arrays[0].strides == tuple(s * 2 for s in t.stride())
    assert np.array_equal(np.asarray(arrays[0], np.float32), t.float().numpy())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 16, requires_grad=True),
    lambda: torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True),
    lambda: torch.randn(4, 16, dtype=torch.float64),
    lambda: torch.randint(0, 9, (4, 16)),
    lambda: torch.randn(4, 16, dtype=torch.complex64).conj(),
    lambda: nn.Parameter(torch.randn(4, 16)),
])
def test_other_inputs_take_torchs_own_layout_and_no_arrays(make):
    t = make()
    sig, arrays = call_layout((t,))
    assert arrays is None and sig == (_torch_layout(t),)


def test_a_grad_input_under_no_grad_and_a_strided_one_agree_with_eager():
    m, x, result = _planned()
    _agrees(result, m, x)
    with torch.no_grad():
        assert torch.allclose(result(x.clone().requires_grad_()), m(x), atol=1e-5)
        wide = torch.randn(16, 4).t()  # the same shape, strided: planned again for that layout
        assert torch.allclose(result(wide), m(wide), atol=1e-5)


@pytest.mark.parametrize("n", [3, 16, 100, 4096, 100_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write", ["mul_", "add_", "zero_", "copy_"])
def test_a_weights_sample_sees_a_write_through_data_and_reads_few_cache_lines(n, dtype, write):
    w = nn.Parameter(torch.randn(n, dtype=dtype) + 3)
    sample = Sampler(w)
    assert sample.same(w)
    {"mul_": lambda d: d.mul_(2), "add_": lambda d: d.add_(1), "zero_": lambda d: d.zero_(),
     "copy_": lambda d: d.copy_(torch.randn(n, dtype=dtype))}[write](w.data)
    assert not sample.same(w)
    if sample.index is not None:
        assert len(set((sample.index // 64).tolist())) <= Sampler.RUNS and len(sample.index) == Sampler.SAMPLES


class ConvBn(nn.Module):
    """A convolution whose BatchNorm the importer folds into its weights: a plan holds values computed from them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


FOLDED_CHANGES = {
    "bn.weight.data.mul_": lambda m: m.bn.weight.data.mul_(3),
    "conv.weight.data.copy_": lambda m: m.conv.weight.data.copy_(torch.randn_like(m.conv.weight)),
    "bn.running_var.add_": lambda m: m.bn.running_var.add_(1.0),
    "bn.running_mean.data set": lambda m: setattr(m.bn.running_mean, "data", torch.randn(8)),
    "bn.eps": lambda m: setattr(m.bn, "eps", 0.5),
    "head.weight.data.zero_": lambda m: m.head.weight.data.zero_(),
    "a replaced head": lambda m: setattr(m, "head", nn.Linear(8, 3)),
}


@pytest.mark.parametrize("change", sorted(FOLDED_CHANGES))
def test_a_change_to_a_folded_or_bound_tensor_gives_eager_torchs_answer(change):
    torch.manual_seed(0)
    m = ConvBn().eval()
    with torch.no_grad():
        m.bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 8, 8)
    result = planner.plan(m, (x,), **FAST)
    assert result.imported.folded_from  # the BatchNorm was folded at import
    _agrees(result, m, x)
    FOLDED_CHANGES[change](m)
    _agrees(result, m, x)


@pytest.mark.parametrize("tags", [True, False], ids=["dict-versions", "ids"])
def test_the_quick_check_answers_an_unchanged_module_and_is_made_again_after_an_equal_value(tags, monkeypatch):
    from planner.torch import guards
    from planner.torch.guards import ModuleState

    if not tags:  # a Python or torch without dict version tags: the dicts compared by the ids they hold
        monkeypatch.setattr(guards, "_dict_version", None)
    elif guards._dict_version is None:
        pytest.skip("this torch reads no dict version tags")
    m = ConvBn().eval()
    keys = [k for k, _ in m.head.named_parameters(prefix="head")]
    state = ModuleState.record(m, keys, [k for k, _ in m.named_parameters() if not k.startswith("head")])
    assert state.quick is not None and state.quick.same() and state.changed() is None
    m.bn.eps = float("1e-5")  # an equal value, another object: the quick check looks closer, finds nothing
    assert not state.quick.same()
    assert state.changed() is None and state.quick.same()
    m.bn.weight.data = m.bn.weight.data.view(2, 4)  # the same memory and version, another shape
    assert "bn.weight" in (state.changed() or "")
    m.bn.weight.data = m.bn.weight.data.view(8)
    assert state.changed() is None
    m.conv.weight.data = m.conv.weight.data.transpose(2, 3)  # the same memory and shape, strided
    assert "conv.weight" in (state.changed() or "")
    m.conv.weight.data = m.conv.weight.data.transpose(2, 3)
    assert state.changed() is None and state.quick.same()
    for change in (lambda: setattr(m.bn, "momentum", 0.5), lambda: setattr(m, "head", nn.Linear(8, 3)),
                   lambda: m.bn.register_buffer("extra", torch.zeros(1)), lambda: m.train()):
        change()
        assert not state.quick.same()


HOOK_CHANGES = {
    "a forward hook": (lambda m: m.conv.register_forward_hook(lambda mod, args, out: out),
                       "a forward hook was registered on or removed from conv"),
    "a global forward pre-hook": (lambda m: nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None),
                                  "every module"),
    "a forward set on the instance": (lambda m: setattr(m.bn, "forward", m.bn.forward), "bn.forward was set to"),
    "a callable attribute replaced": (lambda m: setattr(m, "act", torch.tanh), "act was <built-in method relu"),
}


@pytest.mark.parametrize("tags", [True, False], ids=["dict-versions", "ids"])
@pytest.mark.parametrize("change", sorted(HOOK_CHANGES))
def test_the_quick_check_sees_hooks_and_callables_and_the_full_check_names_them(change, tags, monkeypatch):
    from planner.torch import guards
    from planner.torch.guards import ModuleState

    if not tags:  # nor a count of hook handles: every hook dict is watched
        monkeypatch.setattr(guards, "_dict_version", None)
        monkeypatch.setattr(guards, "_hook_count", lambda: None)
    m = ConvBn().eval()
    m.act = torch.relu
    state = ModuleState.record(m)
    assert state.quick is not None and state.quick.same()
    make, reason = HOOK_CHANGES[change]
    handle = make(m)
    try:
        assert not state.quick.same()
        assert reason in (state.changed() or "")
    finally:
        if handle is not None:
            handle.remove()


def test_a_sample_set_sees_a_write_to_any_of_its_tensors_and_compares_a_strided_one_apart():
    from planner.torch.binding import SampleSet

    tensors = [torch.randn(n) + 3 for n in (5, 64, 1000, 100_003)] + [torch.randn(40, 30).t()]
    samples = SampleSet([(Sampler(t), t) for t in tensors])
    assert samples.same() and len(samples.apart) == 1
    for t in tensors:
        before = t.clone()
        t.mul_(2)
        assert not samples.same()
        t.copy_(before)
        assert samples.same()


def test_the_bound_state_watch_sees_a_replaced_parameter_a_replaced_holder_and_a_write():
    m, x, result = _planned()
    result(x)
    bound = result.bound
    assert bound._watch is not None and bound._watch.same()
    conversions = bound.conversions
    result(x)
    assert bound.conversions == conversions  # nothing converted again
    m.l1.weight.data.mul_(2)
    assert not bound._watch.same()
    _agrees(result, m, x)
    m.l2._parameters = dict(m.l2._parameters)  # the same parameters in another dict
    assert not bound._watch.same()
    _agrees(result, m, x)
    assert bound._watch.same()
