"""``reffsdp.wrap`` decides like ``torch.distributed.fsdp.wrap`` (SPEC 1.5, 2.13 "Auto wrap").

torch's auto-wrap entry point (``_auto_wrap``, which runs ``_recursive_wrap`` for callable
policies and ``_Policy._run_policy`` plus a post-order pass for policy objects) is the
reference: both sides wrap deep copies of one model with a recording wrapper class, and must
construct the same wrappers, around the same modules, in the same order, with the same
kwargs, leaving the same module tree and raising the same warnings. torch's hands each child
the root's kwargs changed per module; ours hands a :class:`~reffsdp.wrap.WrapDecision` (the
changes alone) to the wrapper, which applies it to the root's settings: ``_ours`` below
applies it to the root's kwargs the way the wrapper applies it to its config.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import warnings

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
import torch.nn as nn
from torch.distributed.fsdp._wrap_utils import _auto_wrap as torch_auto_wrap

from reffsdp import wrap as ref_wrap
from reffsdp.api import MixedPrecision
from reffsdp.testing.models import ModelArgs, Transformer, TransformerBlock


class Zoo(nn.Module):
    """Every kind of node the policies treat specially: containers, attention, batch norm,
    a module shared by two parents, a frozen leaf."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        self.stem = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.attn = nn.MultiheadAttention(16, 2)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3)
        )
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 4), "b": nn.Sequential(shared)})
        self.tail = nn.Sequential(shared, nn.Linear(4, 2), nn.BatchNorm1d(2))
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


MODELS = {
    "zoo": Zoo,
    "transformer": lambda: Transformer(ModelArgs(n_layers=3, weight_tying=True)),
}
IGNORED_SUBTREE = {"zoo": "blocks", "transformer": "layers.1"}


def _custom(module: nn.Module):
    if isinstance(module, nn.LayerNorm):
        return {"sharding_strategy": "per-module"}
    if isinstance(module, (nn.Sequential, TransformerBlock)):
        return True
    return {} if isinstance(module, nn.Linear) else False


# name -> (policy from a wrap module), both sides built the same way.
POLICIES = {
    "always": lambda w: w.always_wrap_policy,
    "size_1": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=1),
    "size_100": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=100),
    "size_200": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=200),
    "size_huge": lambda w: w.size_based_auto_wrap_policy,
    "size_custom_sets": lambda w: functools.partial(
        w.size_based_auto_wrap_policy,
        min_num_params=50,
        force_leaf_modules={nn.Sequential},
        exclude_wrap_modules={nn.Linear},
    ),
    "transformer": lambda w: functools.partial(
        w.transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock, nn.Sequential}
    ),
    "lambda": lambda w: functools.partial(
        w.lambda_auto_wrap_policy,
        lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features > 4,
    ),
    "module_wrap": lambda w: w.ModuleWrapPolicy({TransformerBlock, nn.Linear, nn.LayerNorm}),
    "module_wrap_as_callable": lambda w: functools.partial(
        w.ModuleWrapPolicy({TransformerBlock, nn.Linear}).__call__
    ),
    "custom": lambda w: w.CustomPolicy(_custom),
    "or": lambda w: functools.partial(
        w._or_policy,
        policies=[
            functools.partial(w.size_based_auto_wrap_policy, min_num_params=200),
            functools.partial(w._wrap_module_cls_individually, module_classes=[nn.LayerNorm]),
        ],
    ),
}


def _recording_wrapper(log: list, paths: dict[nn.Module, str]) -> type[nn.Module]:
    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module, **kwargs) -> None:
            super().__init__()
            self.module = module
            self.kwargs = kwargs
            # torch's policy-object path passes auto_wrap_policy=None explicitly; the wrapper
            # defaults it to None anyway, so both spellings mean the same.
            shown = {k: v for k, v in kwargs.items() if not (k == "auto_wrap_policy" and v is None)}
            log.append((paths[module], shown))

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    return Wrapper


def _ours(model, policy, wrapper_cls, root_kwargs, ignored_modules=(), ignored_params=()):
    """``reffsdp.wrap.auto_wrap_children`` with children built as the wrapper builds them: the
    root's kwargs, then the decision's overrides, then mixed precision off for full
    precision."""

    def wrap_child(module: nn.Module, decision: ref_wrap.WrapDecision) -> nn.Module:
        kwargs = {**root_kwargs, **decision.overrides}
        if decision.full_precision:
            kwargs["mixed_precision"] = None
        return wrapper_cls(module, **kwargs)

    ref_wrap.auto_wrap_children(
        model,
        policy,
        wrapper_cls,
        wrap_child,
        set(ignored_modules),
        set(ignored_params),
        mixed_precision=root_kwargs.get("mixed_precision"),
        use_orig_params=root_kwargs.get("use_orig_params", False),
    )


def _run(side: str, model: nn.Module, policy_name: str, root_kwargs: dict, ignored: str | None):
    """Auto-wrap ``model`` with torch's or reffsdp's machinery; return what it did."""
    wrap_module = torch_wrap if side == "torch" else ref_wrap
    policy = POLICIES[policy_name](wrap_module)
    paths = {module: path for path, module in model.named_modules()}
    ignored_modules = set(model.get_submodule(ignored).modules()) if ignored else set()
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    log: list = []
    wrapper_cls = _recording_wrapper(log, paths)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if side == "torch":
            torch_auto_wrap(
                model, policy, ignored_modules, ignored_params, dict(root_kwargs), wrapper_cls
            )
        else:
            _ours(model, policy, wrapper_cls, root_kwargs, ignored_modules, ignored_params)
    tree = [(path, type(m).__name__) for path, m in model.named_modules(remove_duplicate=False)]
    return log, tree, len(caught)


@pytest.mark.parametrize("ignore_a_subtree", [False, True])
@pytest.mark.parametrize("mixed_precision", [False, True])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_auto_wrap_matches_torch(model_name, policy_name, mixed_precision, ignore_a_subtree):
    model = MODELS[model_name]()
    ignored = IGNORED_SUBTREE[model_name] if ignore_a_subtree else None
    root_kwargs = {
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16) if mixed_precision else None,
        "sharding_strategy": "root",
        "use_orig_params": True,  # the zoo's frozen leaf may share a wrapper with others
    }
    theirs = _run("torch", copy.deepcopy(model), policy_name, root_kwargs, ignored)
    ours = _run("ours", copy.deepcopy(model), policy_name, root_kwargs, ignored)
    assert ours[0] == theirs[0]  # wrappers: which module, in which order, with which kwargs
    assert ours[1] == theirs[1]  # the resulting module tree
    assert ours[2] == theirs[2]  # warnings (mixed precision overrides, frozen params)
    if policy_name != "size_huge" and not ignore_a_subtree:
        assert ours[0], "the policy wrapped nothing: the comparison is vacuous"


@pytest.mark.parametrize("callable_policy", [False, True])
def test_decisions_carry_only_what_differs_per_module(callable_policy):
    """Each child's decision holds its own overrides (a CustomPolicy's dict, or the module's
    ``_wrap_overrides`` under a callable policy), none shared, and full precision for batch
    norm under mixed precision; the root is the caller's to wrap."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1]._wrap_overrides = {"use_orig_params": True}

    def decide(module: nn.Module) -> bool | dict:
        if module is model[1]:
            return {"use_orig_params": True}
        return module is not model

    policy = ref_wrap.always_wrap_policy if callable_policy else ref_wrap.CustomPolicy(decide)
    decisions = {}

    def wrap_child(module, decision):
        decisions[module] = decision
        return _PlainWrapper(module)

    children = list(model)
    with pytest.warns(UserWarning, match="BatchNorm1d"):
        ref_wrap.auto_wrap_children(
            model,
            policy,
            _PlainWrapper,
            wrap_child,
            set(),
            set(),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
    assert [(dict(decisions[m].overrides), decisions[m].full_precision) for m in children] == [
        ({}, False),
        ({"use_orig_params": True}, False),
        ({}, True),
    ]
    assert not isinstance(model, _PlainWrapper)


class _PlainWrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.module = module


def _half_frozen() -> nn.Module:
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    inner[1].requires_grad_(False)
    return nn.Sequential(inner, nn.Linear(2, 2))


def _is_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_mixed_requires_grad_in_one_wrapper(use_orig_params):
    """Like torch: an error without use_orig_params, a warning with it, naming the FQNs."""
    root_kwargs = {"mixed_precision": None, "use_orig_params": use_orig_params}

    def ours():
        policy = ref_wrap.CustomPolicy(_is_sequential)
        _ours(_half_frozen(), policy, _PlainWrapper, root_kwargs)

    def theirs():
        policy = torch_wrap.CustomPolicy(_is_sequential)
        torch_auto_wrap(_half_frozen(), policy, set(), set(), dict(root_kwargs), _PlainWrapper)

    if use_orig_params:
        with pytest.warns(UserWarning, match=r"requires_grad=True \(\['0\.0\.weight'"):
            ours()
        with pytest.warns(UserWarning, match="requires_grad=True"):
            theirs()
    else:
        with pytest.raises(ValueError, match=r"requires_grad=False \(\['0\.1\.weight'"):
            ours()
        with pytest.raises(ValueError, match="requires_grad=False"):
            theirs()


@pytest.mark.parametrize("policy_name", ["always", "module_wrap", "custom"])
def test_already_wrapped_child_is_a_value_error(policy_name):
    model = nn.Sequential(nn.Linear(2, 2), _PlainWrapper(nn.Sequential(nn.Linear(2, 2))))
    policy = POLICIES[policy_name](ref_wrap)
    with pytest.raises(ValueError, match=r"submodule '1' is already a _PlainWrapper"):
        _ours(model, policy, _PlainWrapper, {})


def test_custom_policy_rejects_other_returns():
    for bad in (None, 1, "yes", [True]):
        policy = ref_wrap.CustomPolicy(lambda m, bad=bad: bad)
        with pytest.raises(ValueError, match="True, False or a dict"):
            policy._run_policy(nn.Linear(2, 2), set(), {})
        torch_policy = torch_wrap.CustomPolicy(lambda m, bad=bad: bad)
        with pytest.raises(ValueError):
            torch_policy._run_policy(nn.Linear(2, 2), set(), {})


def test_batch_norm_runs_in_fp32_like_torch():
    """The mixed-precision override casts batch norm's inputs up and its outputs back."""
    outputs = []
    for side in ("torch", "ours"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        seen = []
        model[1].register_forward_hook(
            lambda m, a, out, seen=seen: seen.append((a[0].dtype, out.dtype))
        )
        wrapper = _recording_wrapper([], {m: p for p, m in model.named_modules()})
        root_kwargs = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
        policy = (torch_wrap if side == "torch" else ref_wrap).ModuleWrapPolicy({nn.Linear})
        with pytest.warns(UserWarning, match="BatchNorm1d"):
            if side == "torch":
                torch_auto_wrap(model, policy, set(), set(), root_kwargs, wrapper)
            else:
                _ours(model, policy, wrapper, root_kwargs)
        out = model[1](torch.ones(3, 4, dtype=torch.bfloat16).cumsum(0))
        assert seen == [(torch.float32, torch.float32)], side
        outputs.append(out)
    assert outputs[0].dtype == outputs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outputs[0], outputs[1])


# -- the callable policies themselves ------------------------------------------------------


@pytest.mark.parametrize("policy_name", sorted(set(POLICIES) - {"custom"}))  # callable ones
def test_callable_policy_answers_like_torch(policy_name):
    theirs, ours = POLICIES[policy_name](torch_wrap), POLICIES[policy_name](ref_wrap)
    for module in Zoo().modules():
        for recurse in (True, False):
            for numel in (0, 1, 99, 100, 10**8):
                kwargs = {"module": module, "recurse": recurse, "nonwrapped_numel": numel}
                assert ours(**kwargs) == theirs(**kwargs), (type(module).__name__, kwargs)


@pytest.mark.parametrize("name", ["_or_policy", "_wrap_module_cls_individually"])
def test_private_helpers_torch_tests_import_have_torchs_signature(name):
    assert inspect.signature(getattr(ref_wrap, name)).parameters.keys() == (
        inspect.signature(getattr(torch_wrap, name)).parameters.keys()
    )


def test_size_based_defaults_are_function_attributes():
    policy = ref_wrap.size_based_auto_wrap_policy
    assert policy.FORCE_LEAF_MODULES == torch_wrap.size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    assert (
        policy.EXCLUDE_WRAP_MODULES == torch_wrap.size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    )


def test_all_matches_torch():
    assert ref_wrap.__all__ == torch_wrap.__all__


def test_module_wrap_policy_repr_names_the_classes():
    assert repr(ref_wrap.ModuleWrapPolicy([nn.Linear, nn.LayerNorm])) == (
        "ModuleWrapPolicy({LayerNorm, Linear})"
    )


# -- enable_wrap / wrap --------------------------------------------------------------------


class _KwargsWrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.module, self.kwargs = module, kwargs


@pytest.mark.parametrize("side", ["torch", "ours"])
def test_enable_wrap_and_wrap(side):
    w = torch_wrap if side == "torch" else ref_wrap
    layer = nn.Linear(2, 2)
    assert w.wrap(layer, a=1) is layer  # outside any context: the module itself
    with w.enable_wrap(wrapper_cls=_KwargsWrapper, a=1, b=2):
        wrapped = w.wrap(layer, b=3, c=4)
        overridden = nn.Linear(2, 2)
        overridden._wrap_overrides = {"c": 5}
        wrapped_overridden = w.wrap(overridden, c=4)
        with pytest.raises(NotImplementedError):
            with w.enable_wrap(wrapper_cls=_KwargsWrapper):
                pass
    assert isinstance(wrapped, _KwargsWrapper) and wrapped.module is layer
    assert wrapped.kwargs == {"a": 1, "b": 3, "c": 4}
    assert wrapped_overridden.kwargs == {"a": 1, "b": 2, "c": 5}
    assert w.wrap(layer) is layer  # the context is gone


def test_enable_wrap_resets_after_an_exception():
    with pytest.raises(RuntimeError):
        with ref_wrap.enable_wrap(wrapper_cls=_KwargsWrapper):
            raise RuntimeError("boom")
    layer = nn.Linear(2, 2)
    assert ref_wrap.wrap(layer) is layer


def test_enable_wrap_is_per_thread():
    """One rank thread's context does not leak into another's."""
    inside, seen = threading.Event(), []

    def other_thread():
        inside.wait()
        layer = nn.Linear(2, 2)
        seen.append(ref_wrap.wrap(layer) is layer)

    thread = threading.Thread(target=other_thread)
    thread.start()
    with ref_wrap.enable_wrap(wrapper_cls=_KwargsWrapper):
        inside.set()
        thread.join()
    assert seen == [True]
