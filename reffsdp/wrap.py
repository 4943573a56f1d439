"""Auto-wrap policies for the wrapper API, and the machinery that applies them.

The public names mirror ``torch.distributed.fsdp.wrap``. :func:`auto_wrap_children` is what
the wrapper's constructor calls when given an ``auto_wrap_policy``: it decides which of the
root's descendants to wrap, and how each differs from the root (a :class:`WrapDecision`),
and hands them to the wrapper to build; the root is left to the caller.

[Note: two kinds of policy]
A *callable* policy ``(module, recurse, nonwrapped_numel) -> bool`` is asked about each
module on a depth-first walk, twice: before the children with ``recurse=True`` ("look
inside?"), and after them with ``recurse=False`` and the numel the children left unwrapped
("wrap this one?"). ``size_based_auto_wrap_policy`` uses that numel to wrap a module once
enough parameters have piled up below it. A *policy object* (:class:`ModuleWrapPolicy`,
:class:`CustomPolicy`, any :class:`_Policy`) instead names every module to wrap, with its
constructor kwargs, in one pass. Either way modules are wrapped bottom-up (post-order), so a
wrapper manages only the parameters its wrapped descendants left, and every child gets the
root's settings but what its :class:`WrapDecision` changes (a :class:`CustomPolicy` dict, or
under a callable policy the module's ``_wrap_overrides``, overrides arguments per module).

[Note: mixed precision skips batch norm]
With ``mixed_precision`` set, instances of ``mixed_precision._module_classes_to_ignore``
(batch norm by default) are wrapped on their own with ``mixed_precision=None``, and forward
hooks run them in fp32: inputs are cast up before their forward and outputs back to the
inputs' dtype after. Their buffers stay in full precision too: the root casts each
instance's buffers to that instance's own ``buffer_dtype``. A warning names the classes.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .api import MixedPrecision
from .core.torch_internals import tree_map_only

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]

ModuleKwargs = dict[nn.Module, dict[str, Any]]


# -- callable policies ---------------------------------------------------------------------


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Look inside every module and wrap every one (each gets its own wrapper)."""
    return True


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Iterable[type], recurse: bool, *args: Any, **kwargs: Any
) -> bool:
    """Look inside every module; wrap the instances of ``module_classes`` (bind them with
    ``partial``). Private, but named and shaped as torch's, whose tests use it."""
    return True if recurse else isinstance(module, tuple(module_classes))


def _or_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable]
) -> bool:
    """Say yes where any of ``policies`` says yes (bind them with ``partial``). Private, but
    named and shaped as torch's, whose tests use it."""
    return any(
        p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies
    )


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable
) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true (bind it with ``partial``)."""
    return True if recurse else lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (bind it with ``partial``)."""
    return _wrap_module_cls_individually(module, transformer_layer_cls, recurse)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are still unwrapped.

    Never looks inside ``force_leaf_modules`` and never wraps ``exclude_wrap_modules``; their
    defaults are this function's attributes ``FORCE_LEAF_MODULES`` and
    ``EXCLUDE_WRAP_MODULES``. Big enough means ``nonwrapped_numel >= min_num_params``, both
    to look inside and to wrap.
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    big_enough = nonwrapped_numel >= min_num_params
    kept_out = force_leaf_modules if recurse else exclude_wrap_modules
    return big_enough and not isinstance(module, tuple(kept_out))


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


# -- policy objects ------------------------------------------------------------------------


class _Policy(ABC):
    """A policy that names every module to wrap and its kwargs in one pass."""

    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> ModuleKwargs:
        """Map each module of ``root_module``'s tree to wrap to its constructor kwargs:
        ``root_kwargs`` with what the policy sets for that module. :func:`auto_wrap_children`
        passes ``{}``, so that only what differs from the root comes back."""


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of ``module_classes``, with the root's kwargs.

    Also usable as a callable policy (``recurse`` always, wrap on ``isinstance``).
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = set(module_classes)

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> ModuleKwargs:
        classes = tuple(self._module_classes)
        return {
            module: copy.copy(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return _wrap_module_cls_individually(module, self._module_classes, recurse)

    def __repr__(self) -> str:
        names = sorted(cls.__name__ for cls in self._module_classes)
        return f"ModuleWrapPolicy({{{', '.join(names)}}})"


class CustomPolicy(_Policy):
    """Ask ``lambda_fn(module)`` about every module: ``False`` or ``{}`` leaves it alone,
    ``True`` wraps it with the root's kwargs, a dict wraps it with the root's kwargs updated
    by the dict. Anything else is a ``ValueError``."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> ModuleKwargs:
        targets: ModuleKwargs = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            decision = self._lambda_fn(module)
            if not isinstance(decision, (bool, dict)):
                raise ValueError(
                    "the lambda_fn of a CustomPolicy must return True, False or a dict of "
                    f"kwargs, but for a {type(module).__name__} it returned {decision!r}"
                )
            if not decision:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(decision, dict):
                kwargs.update(decision)
            targets[module] = kwargs
        return targets


# -- enable_wrap / wrap --------------------------------------------------------------------

# The innermost enable_wrap's (wrapper_cls, kwargs); a context variable, so that threads
# (one per rank in the threaded test harness) each see only their own.
_wrap_context: contextvars.ContextVar[tuple[Callable, dict[str, Any]] | None] = (
    contextvars.ContextVar("reffsdp_wrap_context", default=None)
)


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make :func:`wrap` wrap with ``wrapper_cls(module, **wrapper_kwargs)`` inside the block.

    Contexts do not nest: entering one inside another raises ``NotImplementedError``.
    """
    if _wrap_context.get() is not None:
        raise NotImplementedError(
            "enable_wrap contexts cannot be nested; leave the outer one first"
        )
    token = _wrap_context.set((wrapper_cls, wrapper_kwargs))
    try:
        yield
    finally:
        _wrap_context.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Inside :func:`enable_wrap`, wrap ``module``; outside, return it unchanged.

    The kwargs are the context's, updated by ``wrap_overrides``, updated by the module's own
    ``_wrap_overrides`` attribute if it has one.
    """
    context = _wrap_context.get()
    if context is None:
        return module
    wrapper_cls, context_kwargs = context
    return _wrap(module, wrapper_cls, {**context_kwargs, **wrap_overrides})


def _wrap(module: nn.Module, wrapper_cls: Callable, kwargs: dict[str, Any]) -> nn.Module:
    return wrapper_cls(module, **{**kwargs, **getattr(module, "_wrap_overrides", {})})


# -- applying a policy ---------------------------------------------------------------------


@dataclass(frozen=True)
class WrapDecision:
    """What auto-wrapping decided for one module it wraps, beyond "wrap it": how its wrapper
    differs from the root's. The wrapper applies ``overrides`` first, then
    ``full_precision``."""

    # Constructor arguments by name that a policy gives this module in place of the root's:
    # a CustomPolicy's dict, or the module's ``_wrap_overrides`` under a callable policy.
    # Usually empty.
    overrides: Mapping[str, Any]
    # Batch norm (``_module_classes_to_ignore``) under mixed precision: wrapped with mixed
    # precision off (see [Note: mixed precision skips batch norm]).
    full_precision: bool


def auto_wrap_children(
    root_module: nn.Module,
    policy: Callable[..., bool] | _Policy,
    wrapper_cls: type[nn.Module],
    wrap_child: Callable[[nn.Module, WrapDecision], nn.Module],
    ignored_modules: set[nn.Module] | frozenset[nn.Module],
    ignored_params: set[nn.Parameter] | frozenset[nn.Parameter],
    *,
    mixed_precision: MixedPrecision | None = None,
    use_orig_params: bool = False,
) -> None:
    """Wrap the modules of ``root_module``'s tree that ``policy`` picks, except the root:
    ``wrap_child(module, decision)`` returns each one's wrapper (a ``wrapper_cls``), which
    replaces it in its parents.

    ``ignored_modules`` holds every module of the ignored subtrees and ``ignored_params``
    their parameters (plus any parameters ignored on their own); ``mixed_precision`` is the
    root's, as given (``None``: batch norm is wrapped like any module), ``use_orig_params``
    the root's (whether a wrapper may mix frozen and trainable parameters). See [Note: two
    kinds of policy] and [Note: mixed precision skips batch norm]. A module already wrapped
    by ``wrapper_cls`` is a ``ValueError``.
    """
    _check_not_wrapped(root_module, wrapper_cls)
    full_precision_classes = tuple(
        set(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
    )
    if isinstance(policy, _Policy):
        # The root's settings travel with ``wrap_child``: asked with none, a policy answers
        # with what differs per module.
        overrides = policy._run_policy(root_module, ignored_modules, {})
        full_precision = {
            module
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, full_precision_classes)
        }
        targets = {module: overrides.get(module, {}) for module in [*overrides, *full_precision]}
        _run_in_full_precision(root_module, full_precision_classes, wrapper_cls)
        _check_uniform_requires_grad(root_module, targets, ignored_params, use_orig_params)
        for parent, name, module in _post_order(root_module):
            if module in targets:
                decision = WrapDecision(targets[module], module in full_precision)
                setattr(parent, name, wrap_child(module, decision))
        return
    if full_precision_classes:
        _run_in_full_precision(root_module, full_precision_classes, wrapper_cls)
        wrap_alone = functools.partial(
            _wrap_module_cls_individually, module_classes=full_precision_classes
        )
        policy = functools.partial(_or_policy, policies=(policy, wrap_alone))

    def wrap_fn(module: nn.Module) -> nn.Module:
        # A module's own ``_wrap_overrides`` win over batch norm's full precision here, as
        # they win over every other argument when ``wrap()`` wraps.
        overrides = getattr(module, "_wrap_overrides", {})
        full_precision = isinstance(module, full_precision_classes)
        if "mixed_precision" in overrides:
            full_precision = False
        return wrap_child(module, WrapDecision(overrides, full_precision))

    _wrap_recursively(root_module, policy, wrap_fn, ignored_modules, ignored_params, True)


def _check_not_wrapped(root_module: nn.Module, wrapper_cls: Callable) -> None:
    if not isinstance(wrapper_cls, type):
        return
    for path, module in root_module.named_modules():
        if isinstance(module, wrapper_cls):
            where = f"the submodule {path!r}" if path else "the root module"
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but "
                f"found {path} in the {type(root_module).__name__} to wrap: {where} is already "
                f"a {wrapper_cls.__name__}; wrap either by hand or with an auto_wrap_policy, "
                "not both"
            )


def _wrap_recursively(
    module: nn.Module,
    policy: Callable[..., bool],
    wrap_fn: Callable[[nn.Module], nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    is_root: bool,
) -> tuple[nn.Module, int]:
    """Apply a callable policy below ``module``; return it (maybe wrapped) and the numel
    wrapped in its subtree."""
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, numel = _wrap_recursively(
            child, policy, wrap_fn, ignored_modules, ignored_params, False
        )
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += numel
    remaining = nonwrapped_numel - wrapped_numel
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remaining):
        return wrap_fn(module), nonwrapped_numel
    return module, wrapped_numel


def _post_order(root_module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, module)`` for every module below the root, each once, children
    first. Safe to ``setattr(parent, name, ...)`` while iterating."""
    visited = {root_module}

    def visit(parent: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
        for name, child in parent.named_children():
            if child not in visited:
                visited.add(child)
                yield from visit(child)
                yield parent, name, child

    yield from visit(root_module)


def _run_in_full_precision(
    root_module: nn.Module, classes: tuple[type, ...], wrapper_cls: Callable
) -> None:
    """Hook every instance of ``classes`` to compute in fp32 (see [Note: mixed precision
    skips batch norm])."""
    modules = [m for m in root_module.modules() if isinstance(m, classes)]
    if not modules:
        return
    for module in modules:
        _cast_through_fp32(module)
    names = ", ".join(sorted({type(m).__name__ for m in modules}))
    warnings.warn(
        f"mixed precision and an auto_wrap_policy were both given to "
        f"{getattr(wrapper_cls, '__name__', 'the wrapper')}; submodules of type {names} are "
        "wrapped on their own with mixed precision disabled",
        stacklevel=3,
    )


def _cast_through_fp32(module: nn.Module) -> None:
    """Cast low-precision floating inputs to fp32 before ``module``'s forward, and its
    floating outputs back to the (last) input dtype that was cast."""
    cast_from: list[torch.dtype] = []  # this forward's input dtypes that were cast up

    def to_fp32(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(x) or x.dtype == torch.float32:
            return x
        cast_from.append(x.dtype)
        return x.float()

    def pre_forward(module: nn.Module, args: Any) -> Any:
        cast_from.clear()
        return tree_map_only(torch.Tensor, to_fp32, args)

    def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
        if not cast_from:
            return None
        dtype = cast_from[-1]
        return tree_map_only(
            torch.Tensor, lambda x: x.to(dtype) if torch.is_floating_point(x) else x, output
        )

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def _check_uniform_requires_grad(
    root_module: nn.Module,
    targets: ModuleKwargs,
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Each module to wrap must manage only trainable or only frozen parameters: a
    ``ValueError`` without ``use_orig_params``, a warning with it (gradient memory for the
    frozen ones)."""
    claimed: set[nn.Module] = set()  # modules whose parameters a deeper target manages
    paths = {module: path for path, module in root_module.named_modules()}
    order = [module for _, _, module in _post_order(root_module)] + [root_module]
    for module in (m for m in order if m in targets):
        managed = _managed_params(module, paths[module], claimed, ignored_params)
        trainable = [fqn for param, fqn in managed.items() if param.requires_grad]
        frozen = [fqn for param, fqn in managed.items() if not param.requires_grad]
        if not (trainable and frozen):
            continue
        message = (
            f"{paths[module] or 'the root module'} would manage parameters with both "
            f"requires_grad=True ({trainable}) and requires_grad=False ({frozen}); "
        )
        if not use_orig_params:
            raise ValueError(
                message + "that needs use_orig_params=True, or wrap the frozen ones separately"
            )
        warnings.warn(
            message + "their gradients take memory as if all were trainable; wrap the frozen "
            "ones separately to avoid that",
            stacklevel=3,
        )


def _managed_params(
    module: nn.Module, path: str, claimed: set[nn.Module], ignored_params: set[nn.Parameter]
) -> dict[nn.Parameter, str]:
    """Parameter -> FQN of what ``module`` manages, skipping claimed subtrees; claims them."""
    managed: dict[nn.Parameter, str] = {}
    claimed.add(module)
    queue = deque([(module, path)])
    while queue:
        current, prefix = queue.popleft()
        for name, param in current.named_parameters(recurse=False):
            if param not in ignored_params:
                managed[param] = f"{prefix}.{name}" if prefix else name
        for name, child in current.named_children():
            if child not in claimed:
                claimed.add(child)
                queue.append((child, f"{prefix}.{name}" if prefix else name))
    return managed
