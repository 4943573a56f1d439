"""Parity checks: does a sharded model hold and learn what an unsharded reference does?

* :func:`check_sharded_parity` compares the parameters and gradients of a sharded model,
  shard by shard, with those of an unsharded reference model.
* :func:`check_train_parity` trains a sharded model next to a ``DistributedDataParallel``
  reference and compares losses, gradients and parameters at every step.
* :func:`check_state_dict_parity` compares a sharded model's state dict, gathered, with
  the reference's.
* :func:`broadcast_params_from_rank0` makes a model identical on every rank before a test
  copies and shards it (threads of the threaded harness share one RNG, so two ranks that
  build "the same" model get different weights).

Default tolerances are derived from the dtype, the reduce dtype the sharded model declares
and the number of ranks summed (see [Note: default tolerances] in
:mod:`reffsdp.testing.tolerances`); ``rtol``/``atol`` set them, for every dtype or per dtype
(``{torch.bfloat16: 1e-2, torch.float32: 1e-5}``). The checks take models sharded by reffsdp
or by torch's FSDP, either API.

[Note: comparing shards]
A sharded parameter is a DTensor; what a rank holds is ``param.to_local()``. The expected
shard is the reference tensor cut the same way: ``distribute_tensor(ref, mesh, placements,
src_data_rank=None).to_local()``, where ``src_data_rank=None`` makes each rank cut its own
copy of the reference instead of receiving rank 0's. Two ranks, ``Shard(0)``, a reference
of three rows ``[r0, r1, r2]``: rank 0 expects ``[r0, r1]`` and rank 1 expects ``[r2]``,
the unpadded chunks of ``torch.chunk``.

``(Shard(0), Shard(0))`` on a 2D mesh cannot be checked this way. ``distribute_tensor``
splits along the outer mesh dimension first, FSDP splits the inner (tensor-parallel) shard
again. Four rows, mesh ``(dp=2, tp=2)``: ``distribute_tensor`` gives coordinate
``(dp, tp)`` row ``2 * dp + tp``, while FSDP over a row-wise TP shard gives it row
``2 * tp + dp``. Such parameters are rejected with a ``ValueError``.

[Note: ranks agree on the verdict]
A mismatch is often on one rank only (one rank's gradient scaled wrongly). If that rank
raised alone, the others would walk into the next collective and wait for it forever. So
every check ends with a small all-reduce that tells each rank which ranks failed, and then
all of them fail together: the failing ranks with their own mismatches, the others with a
line naming the failing ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import unittest
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from reffsdp.core.autograd_hooks import map_tensors
from reffsdp.core.torch_internals import registered_children, tree_leaves

from . import preflight
from .expected_comms import COUNT_KEYS, CommTally
from .patching import observe_collectives
from .tolerances import Tolerance, Tolerances, model_reduce_dtype

_MAX_REPORTED_PROBLEMS = 10


def check_sharded_parity(
    test_case: unittest.TestCase | None,
    ref_model: nn.Module,
    sharded_model: nn.Module,
    prefixes_to_ignore: Sequence[str] = (),
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
) -> None:
    """Check that every parameter and gradient of ``sharded_model`` is the right shard.

    Parameter names must match once every occurrence of each of ``prefixes_to_ignore`` is
    removed from the sharded names (for wrapper prefixes such as
    ``"_checkpoint_wrapped_module."``). Every sharded parameter must be a DTensor whose local
    shard equals the reference cut by its placements (see [Note: comparing shards]); the
    same holds for gradients, and a ``None`` gradient must match a ``None`` one.

    Failures go through ``test_case.fail`` when a test case is given, else raise
    ``AssertionError``; either way each line names the tensor, the rank and the largest
    absolute difference. Every rank of the default group must call this together (see
    [Note: ranks agree on the verdict]). ``rtol``/``atol``: one number, or one per dtype;
    by default derived from the dtype and the world size (see
    [Note: default tolerances] in :mod:`reffsdp.testing.tolerances`).
    """
    tolerances = _tolerances(rtol, atol, sharded_model)
    problems = _param_problems(
        ref_model, sharded_model, prefixes_to_ignore, require_dtensor=True, tolerances=tolerances
    )
    _agree_and_report(test_case, "check_sharded_parity", problems)


def check_state_dict_parity(
    test_case: unittest.TestCase | None,
    ref_model: nn.Module,
    sharded_model: nn.Module,
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
) -> None:
    """Check that ``sharded_model.state_dict()`` gathers to ``ref_model.state_dict()``.

    The names must match in order; every parameter's entry must be a DTensor, gathered
    with ``full_tensor()``; buffers compare as they are. Fails like
    :func:`check_sharded_parity`, and every rank of the default group must call it together.
    """
    tolerances = _tolerances(rtol, atol, sharded_model)
    state_dict, ref_state_dict = sharded_model.state_dict(), ref_model.state_dict()
    names, ref_names = list(state_dict), list(ref_state_dict)
    name_problems = [] if names == ref_names else [_name_mismatch(names, ref_names)]
    _agree_and_report(test_case, "check_state_dict_parity", name_problems)
    param_names = {name for name, _ in sharded_model.named_parameters()}
    problems = []
    for name, value in state_dict.items():
        where = f"state dict entry {name!r} on rank {dist.get_rank()}"
        if name in param_names and not isinstance(value, DTensor):
            problems.append(f"{where}: a {type(value).__name__}, expected a DTensor")
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        mismatch = _mismatch(full.detach(), ref_state_dict[name].detach(), tolerances)
        if mismatch:
            problems.append(f"{where}: {mismatch}")
    _agree_and_report(test_case, "check_state_dict_parity", problems)


def check_train_parity(
    test_case: unittest.TestCase | None,
    ref_model: nn.Module,
    sharded_model: nn.Module,
    make_inputs: Callable[[int, int], Any],
    *,
    num_steps: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    num_microbatches: int = 1,
    no_sync: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    prefixes_to_ignore: Sequence[str] = (),
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    block_types: Sequence[type[nn.Module]] = (),
    expected_counts: Mapping[str, float] | None = None,
    around_sharded_step: Callable[[], AbstractContextManager[Any]] | None = None,
) -> TrainParity:
    """Train ``sharded_model`` and a DDP copy side by side; check they agree at every step.

    ``ref_model`` is the unsharded twin of ``sharded_model``: the caller deep-copies the
    model *before* sharding it (sharding changes the module in place) and passes the copy.
    Both must start from the same weights on every rank (:func:`reference_and_model` or
    :func:`broadcast_params_from_rank0` before copying); when the ranks' references differ,
    the check says so. This function wraps ``ref_model`` itself in
    ``DistributedDataParallel`` (with ``ddp_kwargs``, e.g. ``find_unused_parameters=True``)
    and trains it, so the caller can inspect it afterwards. Parameters may be DTensors
    (compared shard by shard) or plain tensors (compared whole); a model wrapped with
    ``reffsdp.FullyShardedDataParallel`` is compared through its original parameters and
    gradients, rebuilt whole from the flat shards (see :func:`unflattened_params`), another
    implementation's (torch's) through its own ``summon_full_params``
    (:func:`summoned_params`), and a ``reffsdp.naive.NaiveFSDP`` through its parameters
    gathered whole (:func:`naive_params`).

    ``make_inputs(iteration, rank)`` returns one forward's inputs: a tensor, a tuple of
    positional arguments, or a dict of keyword arguments (``{"input_ids": ...,
    "attention_mask": ...}``), any of them nesting tensors in lists, tuples and dicts;
    ``iteration`` counts forwards from 0, so step ``s`` uses iterations
    ``s * num_microbatches`` onwards. Both models get the same object, so neither may modify
    it in place. ``loss_fn`` maps the output to a scalar (default :func:`sum_loss`; for a
    model that returns an output object, e.g. ``lambda out: out.loss``);
    ``optimizer_factory`` builds an optimizer from parameters (default
    :func:`sgd_with_momentum`: unlike Adam, SGD's update scales with the gradient, so a wrong
    gradient scale changes the parameters).

    Each step runs ``num_microbatches`` forward/backward passes, accumulating gradients.
    With ``no_sync``, all but the last run inside ``no_sync(sharded_model)`` for the sharded
    model and ``ddp.no_sync()`` for the reference. Checked: parameters before training;
    every microbatch's loss; gradients after backward; parameters after the optimizer step.
    ``rtol``/``atol`` (one number, or one per dtype) replace the default tolerance, which
    grows with the dtype's epsilon (or that of the reduce dtype ``sharded_model``
    declares, where it has less precision), the world size, the microbatches and the
    steps taken (see [Note: default tolerances] in :mod:`reffsdp.testing.tolerances`).

    Optional structure checks, made before training: ``block_types``, the classes of the
    blocks the caller shards on their own, fail the check when they match no module of
    ``sharded_model`` or when one of them was not sharded (a forgotten ``fully_shard``, a
    block an auto-wrap policy missed); ``expected_counts``, collectives per step as
    :func:`reffsdp.testing.expected_counts` computes them, fails the check when a step
    issues other numbers of reffsdp all-gathers, reduce-scatters or all-reduces.
    ``around_sharded_step()`` gives a context entered around every forward and backward,
    and every optimizer step, of ``sharded_model`` alone (the parity suite observes the
    collectives of the FSDP under test in it).

    Returns this rank's loss per step, summed over microbatches, as a :class:`TrainParity`
    (a list) that also carries the largest differences seen on any rank and the tolerances
    they were held to. A failure raises ``AssertionError`` (or fails ``test_case``); the
    exception carries this rank's differences so far as ``error.parity``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    _check_count_keys(expected_counts)
    unsharded = preflight.unsharded_blocks_message(sharded_model, block_types)
    if unsharded:
        _fail(test_case, f"check_train_parity, before training: {unsharded}")
    tolerances = _tolerances(rtol, atol, sharded_model, num_microbatches)
    other_weights = preflight.ranks_with_other_weights(ref_model)
    run = _TrainParityRun(
        test_case,
        ref_model,
        sharded_model,
        optimizer_factory or sgd_with_momentum,
        loss_fn=loss_fn or sum_loss,
        no_sync=no_sync,
        prefixes_to_ignore=prefixes_to_ignore,
        ddp_kwargs=ddp_kwargs or {},
        tolerances=tolerances,
        expected_counts=expected_counts,
        around_sharded_step=around_sharded_step or contextlib.nullcontext,
    )
    rank = dist.get_rank()
    step_losses = []
    try:
        weights_hint = preflight.WEIGHTS_HINT.format(ranks=other_weights) if other_weights else ""
        drift = run.check_params("before training", 0, weights_hint)
        for step in range(num_steps):
            first = step * num_microbatches
            inputs = [make_inputs(i, rank) for i in range(first, first + num_microbatches)]
            drift, loss = run.step(step, inputs, drift)
            step_losses.append(loss)
    except AssertionError as error:
        error.parity = run.diffs  # type: ignore[attr-defined]
        raise
    return TrainParity(step_losses, run.diffs.agreed())


def _tolerances(
    rtol: Tolerance, atol: Tolerance, sharded_model: nn.Module, num_microbatches: int = 1
) -> Tolerances:
    """The caller's tolerances, with defaults for this world and for the reduce dtype the
    sharded model declares (point 6 of [Note: default tolerances])."""
    return Tolerances(
        rtol,
        atol,
        world_size=dist.get_world_size(),
        num_microbatches=num_microbatches,
        reduce_dtype=model_reduce_dtype(sharded_model),
    )


class _TrainParityRun:
    """One :func:`check_train_parity`: the two models, their optimizers and what each
    step checks."""

    def __init__(
        self,
        test_case: unittest.TestCase | None,
        ref_model: nn.Module,
        sharded_model: nn.Module,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        *,
        loss_fn: Callable[[Any], torch.Tensor],
        no_sync: Callable[[nn.Module], AbstractContextManager[Any]] | None,
        prefixes_to_ignore: Sequence[str],
        ddp_kwargs: Mapping[str, Any],
        tolerances: Tolerances,
        expected_counts: Mapping[str, float] | None,
        around_sharded_step: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        self.test_case = test_case
        self.ref_model = ref_model
        self.sharded_model = sharded_model
        self.ddp_model = DistributedDataParallel(ref_model, **ddp_kwargs)
        self.ref_optim = optimizer_factory(self.ddp_model.parameters())
        self.optim = optimizer_factory(sharded_model.parameters())
        self.loss_fn = loss_fn
        self.no_sync = no_sync
        self.ddp_no_sync = (lambda _: self.ddp_model.no_sync()) if no_sync is not None else None
        self.prefixes_to_ignore = prefixes_to_ignore
        self.tolerances = tolerances
        self.expected_counts = expected_counts
        self.around_sharded_step = around_sharded_step
        self.diffs = ParityDiffs()

    def check_params(self, when: str, reductions: int, hint: str = "") -> float:
        """Compare the weights (or gradients); returns the largest weight difference seen
        on any rank so far."""
        problems = _param_problems(
            self.ref_model,
            self.sharded_model,
            self.prefixes_to_ignore,
            require_dtensor=False,
            tolerances=self.tolerances,
            reductions=reductions,
            diffs=self.diffs,
        )
        drift = self.diffs.max_param_diff or 0.0
        return _agree_and_report(
            self.test_case, f"check_train_parity, {when}", problems, hint, drift
        )

    def step(self, step: int, inputs: list[Any], drift: float) -> tuple[float, float]:
        """Train both models one step on ``inputs`` (one per microbatch) and check it;
        returns the weights' drift after it and this rank's loss, summed over microbatches."""
        self.ref_optim.zero_grad()
        self.optim.zero_grad()
        ref_losses = _forward_backward(self.ddp_model, inputs, self.loss_fn, self.ddp_no_sync)
        tally = CommTally()
        with _counting(tally, self.expected_counts), self.around_sharded_step():
            losses = _forward_backward(self.sharded_model, inputs, self.loss_fn, self.no_sync)
        slack = 2 * drift * _grad_l1(self.ref_model)  # point 5 of [Note: default tolerances]
        loss_problems = _loss_problems(
            losses, ref_losses, self.tolerances, max(step, 1), self.diffs, slack
        )
        _agree_and_report(
            self.test_case,
            f"check_train_parity, step {step} losses",
            loss_problems,
            _dropout_hint(self.ref_model) if step == 0 else "",
        )
        self.check_params(f"step {step} after backward", step + 1)
        if step == 0:
            _check_gradients_not_vacuous(self.ref_model)
        self.ref_optim.step()
        with _counting(tally, self.expected_counts), self.around_sharded_step():
            self.optim.step()
        if self.expected_counts is not None:
            _agree_and_report(
                self.test_case,
                f"check_train_parity, step {step} collectives",
                _count_problems(tally, self.expected_counts),
            )
        drift = self.check_params(f"step {step} after the optimizer step", step + 1)
        return drift, sum(_full(loss).item() for loss in losses)


@dataclasses.dataclass
class ParityDiffs:
    """The largest absolute differences a parity check saw, and the tolerances it used.

    ``None`` for a kind never compared. Each rank keeps its own until :meth:`agreed`, a
    collective, takes the maximum over the ranks of the default group.
    """

    max_loss_diff: float | None = None
    max_grad_diff: float | None = None
    max_param_diff: float | None = None
    rtol: float | None = None
    atol: float | None = None

    def observe(
        self, kind: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
    ) -> None:
        """Record ``max |actual - expected|`` for ``kind`` ("loss", "grad" or "param")."""
        field = f"max_{kind}_diff"
        diff = (actual.detach().double() - expected.detach().double()).abs()
        value = diff.max().item() if diff.numel() else 0.0
        previous = getattr(self, field)
        setattr(self, field, value if previous is None else max(previous, value))
        self.rtol = rtol if self.rtol is None else max(self.rtol, rtol)
        self.atol = atol if self.atol is None else max(self.atol, atol)

    def agreed(self) -> ParityDiffs:
        """The maximum of every field over the ranks (every rank must call this together)."""
        names = [f.name for f in dataclasses.fields(self)]
        values = [getattr(self, name) for name in names]
        # float64: a tolerance of 1e-05 stays 1e-05, not float32's 9.999999747378752e-06.
        tensor = torch.tensor(
            [-1.0 if v is None else v for v in values], dtype=torch.float64, device=_flag_device()
        )
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return ParityDiffs(*[None if v < 0 else v for v in tensor.tolist()])


class TrainParity(list):
    """What :func:`check_train_parity` returns: this rank's loss per step (a list, as it
    always was) with the differences every rank saw as :attr:`diffs`."""

    def __init__(self, losses: Iterable[float], diffs: ParityDiffs) -> None:
        super().__init__(losses)
        self.diffs = diffs

    @property
    def max_loss_diff(self) -> float | None:
        return self.diffs.max_loss_diff

    @property
    def max_grad_diff(self) -> float | None:
        return self.diffs.max_grad_diff

    @property
    def max_param_diff(self) -> float | None:
        return self.diffs.max_param_diff


class VacuousParityWarning(UserWarning):
    """A parity check compared only zero gradients, so it could not have failed."""


def _check_gradients_not_vacuous(ref_model: nn.Module) -> None:
    """Warn when the reference has no non-zero gradient on any rank at step 0.

    Then every gradient comparison passes whatever the sharded model does (e.g. every ReLU
    of a small model dead for the drawn weights), and a broken reduction goes unnoticed.
    Tests whose point is to show a bug is caught should fix their initialization.
    """
    grads = [p.grad for p in ref_model.parameters() if p.grad is not None]
    nonzero = torch.tensor([float(any(bool(g.any()) for g in grads))], device=_flag_device())
    dist.all_reduce(nonzero, op=dist.ReduceOp.MAX)
    if not nonzero.item():
        warnings.warn(
            "check_train_parity: every reference gradient is zero at step 0 on every rank, so "
            "the gradient checks prove nothing; change the inputs, the initialization or the "
            "loss",
            VacuousParityWarning,
            stacklevel=3,
        )


class LowPrecisionCompute(nn.Module):
    """A fair unsharded reference for mixed-precision FSDP.

    FSDP computes with ``param_dtype`` copies of the parameters and reduces gradients in
    fp32 while the optimizer steps the fp32 shards. This module does the same without
    sharding: it runs ``module`` through ``functional_call`` with every parameter and every
    floating-point tensor of the inputs cast to ``param_dtype`` (floating-point outputs cast
    to ``output_dtype`` when given), so autograd returns the low-precision gradient cast to
    fp32, which DDP then averages in fp32. Inputs and outputs may be any nesting of tuples,
    lists, dicts and dataclasses; integer tensors (token ids, masks) pass unchanged, as
    FSDP's own input cast leaves them.
    Pair it with :class:`Passthrough` around the sharded model so parameter names match.
    With ``buffer_dtype`` floating-point buffers are cast too (the wrapper API's
    ``MixedPrecision.buffer_dtype``).
    """

    def __init__(
        self,
        module: nn.Module,
        param_dtype: torch.dtype,
        output_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.param_dtype = param_dtype
        self.output_dtype = output_dtype
        self.buffer_dtype = buffer_dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = {name: p.to(self.param_dtype) for name, p in self.module.named_parameters()}
        if self.buffer_dtype is not None:
            for name, buffer in self.module.named_buffers():
                if buffer.is_floating_point():
                    params[name] = buffer.to(self.buffer_dtype)
        args, kwargs = _cast_floating((args, kwargs), self.param_dtype)
        out = torch.func.functional_call(self.module, params, args, kwargs)
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype``, the others unchanged."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class Passthrough(nn.Module):
    """Calls ``module``; gives a model the ``module.`` name prefix a reference wrapper has."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> float:
    """One plain step: zero grads, forward, backward, optimizer step; returns the loss."""
    optim.zero_grad()
    loss = (loss_fn or sum_loss)(_call(model, inputs))
    loss.backward()
    optim.step()
    return loss.item()


def local_data_parallel_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    make_inputs: Callable[[int, int], Any],
    iteration: int,
    world_size: int,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> list[float]:
    """One data-parallel step of ``world_size`` ranks, simulated on one unsharded model.

    The loss is the mean of every rank's loss, so the gradient is the rank average that
    data parallelism computes. A reference where DDP cannot run, e.g. several ranks
    sharing one GPU, or one world size continuing another's training. Returns each rank's
    loss.
    """
    loss_fn = loss_fn or sum_loss
    optim.zero_grad()
    losses = [loss_fn(_call(model, make_inputs(iteration, r))) for r in range(world_size)]
    (torch.stack(losses).sum() / world_size).backward()
    optim.step()
    return [loss.item() for loss in losses]


@contextlib.contextmanager
def gradient_sync_off(module: nn.Module, *, reshard_after_backward: bool = True) -> Iterator[None]:
    """No gradient reduction while open (``set_requires_gradient_sync``); a ``no_sync``
    for :func:`check_train_parity` with ``FSDPModule``s.

    With ``reshard_after_backward=False`` the parameters also stay unsharded after each
    backward while open (``set_reshard_after_backward``, back to ``True`` on exit), so the
    next microbatch's forward need not gather them again.
    """
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    if not reshard_after_backward:
        module.set_reshard_after_backward(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]
        if not reshard_after_backward:
            module.set_reshard_after_backward(True)  # type: ignore[operator]


@contextlib.contextmanager
def all_reduce_off(module: nn.Module) -> Iterator[None]:
    """HSDP: reduce-scatter but no all-reduce across replicas while open."""
    module.set_requires_all_reduce(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_all_reduce(True)  # type: ignore[operator]


def sum_loss(output: Any) -> torch.Tensor:
    """The sum of every element of every tensor in ``output``, in fp32.

    ``output`` is a tensor or any nesting of tuples, lists and dicts of tensors (``None``
    entries are skipped). A model that returns something else, such as an output object that
    holds a cache, needs a ``loss_fn`` of its own: ``TypeError`` says so.
    """
    leaves = [leaf for leaf in tree_leaves(output) if leaf is not None]
    others = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
    if others or not leaves:
        if leaves == [output]:
            found = f"it returned a {type(output).__name__}"
        else:
            found = f"its {type(output).__name__} holds {', '.join(others) or 'no tensor'}"
        raise TypeError(
            f"sum_loss adds up the tensors a model returns, but {found}; pass loss_fn= "
            "mapping the output to a scalar, e.g. loss_fn=lambda out: out.loss"
        )
    return torch.stack([tensor.float().sum() for tensor in leaves]).sum()


def sgd_with_momentum(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``SGD(lr=1e-2, momentum=0.9)``: the default optimizer of :func:`check_train_parity`."""
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def broadcast_params_from_rank0(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank 0's values, in place.

    Call it before deep-copying the reference and before sharding: sharded (DTensor)
    parameters are refused with a ``TypeError``, as each rank holds a different piece.
    """
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if isinstance(tensor, DTensor):
                raise TypeError(f"{name!r} is already a DTensor; broadcast before sharding")
            dist.broadcast(tensor, group=process_group, group_src=0)


def _param_problems(
    ref_model: nn.Module,
    model: nn.Module,
    prefixes_to_ignore: Sequence[str],
    *,
    require_dtensor: bool,
    tolerances: Tolerances,
    reductions: int = 1,
    diffs: ParityDiffs | None = None,
) -> list[str]:
    """One line per parameter or gradient of ``model`` that differs from ``ref_model``.

    ``reductions``: how many gradient reductions can have reached the values (see
    [Note: default tolerances] in :mod:`reffsdp.testing.tolerances`).
    """
    compare = _Comparison(tolerances, reductions, diffs)
    whole = unflattened_params(model, prefixes_to_ignore)
    if whole is None:
        whole = summoned_params(model, prefixes_to_ignore)
    if whole is None:
        whole = naive_params(model, prefixes_to_ignore)
    if whole is not None:
        return _unflattened_problems(ref_model, whole, compare)
    ref_named = list(ref_model.named_parameters())
    named = list(model.named_parameters())
    ref_names = [name for name, _ in ref_named]
    names = [_strip_prefixes(name, prefixes_to_ignore) for name, _ in named]
    if names != ref_names:
        return [_name_mismatch(names, ref_names)]
    problems = []
    for name, (_, ref_param), (_, param) in zip(names, ref_named, named):
        if not isinstance(param, DTensor) and require_dtensor:
            problems.append(f"{name!r} is a {type(param).__name__}, expected a DTensor")
            continue
        problems += _tensor_problems(f"param {name!r}", ref_param, param, param, compare, "param")
        if ref_param.grad is None or param.grad is None:
            if (ref_param.grad is None) != (param.grad is None):
                problems.append(
                    f"grad of {name!r} on rank {dist.get_rank()}: "
                    f"{_none_or_set(param.grad)} but the reference's is "
                    f"{_none_or_set(ref_param.grad)}"
                )
            continue
        problems += _tensor_problems(
            f"grad of {name!r}", ref_param.grad, param.grad, param, compare, "grad"
        )
    return problems


def _tensor_problems(
    what: str,
    ref: torch.Tensor,
    actual: torch.Tensor,
    param: torch.Tensor,
    compare: _Comparison,
    kind: str,
) -> list[str]:
    """Compare ``actual`` with ``ref`` cut the way ``param`` is sharded (if it is a DTensor)."""
    where = f"{what} on rank {dist.get_rank()}"
    if isinstance(param, DTensor):
        if not isinstance(actual, DTensor):
            return [f"{where}: a {type(actual).__name__}, expected a DTensor"]
        if tuple(actual.placements) != tuple(param.placements):
            return [f"{where}: placements {actual.placements}, expected {param.placements}"]
        if tuple(param.placements) == (Shard(0), Shard(0)):
            raise ValueError(
                f"{what} has placements (Shard(0), Shard(0)), whose shards differ from "
                "distribute_tensor's; see [Note: comparing shards] in reffsdp.testing.parity"
            )
        expected = distribute_tensor(
            ref.detach(), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        actual = actual.to_local()
    else:
        expected = ref
    mismatch = compare(actual.detach(), expected.detach(), kind, scale=ref.detach())
    return [f"{where}: {mismatch}"] if mismatch else []


@dataclasses.dataclass(frozen=True)
class _Comparison:
    """Compares tensors under ``tolerances`` and records the differences in ``diffs``."""

    tolerances: Tolerances
    reductions: int = 1
    diffs: ParityDiffs | None = None
    slack: float = 0.0  # added to a default atol (point 5 of [Note: default tolerances])

    def __call__(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        kind: str,
        scale: torch.Tensor | None = None,
    ) -> str | None:
        """How ``actual`` differs from ``expected``, or ``None`` when they are close.

        ``scale``: the whole reference tensor when ``expected`` is a piece of it. The
        largest difference is recorded in ``diffs`` as ``kind`` ("loss", "grad", "param").
        """
        return _mismatch(
            actual, expected, self.tolerances, scale, self.reductions, self.diffs, kind, self.slack
        )


def _mismatch(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: Tolerances,
    scale: torch.Tensor | None = None,
    reductions: int = 1,
    diffs: ParityDiffs | None = None,
    kind: str = "param",
    slack: float = 0.0,
) -> str | None:
    """How ``actual`` differs from ``expected``, or ``None`` when they are close; ``slack``
    widens the default ``atol`` (not one the caller gave)."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    actual = actual.to(expected.device)  # offloaded shards live on the CPU
    rtol, atol = tolerances.for_comparison(expected, scale, reductions)
    if tolerances.given(expected.dtype) is None:
        atol += slack
    if diffs is not None:
        diffs.observe(kind, actual, expected, rtol, atol)
    if torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        return None
    max_diff = (actual.double() - expected.double()).abs().max().item()
    return f"max abs diff {max_diff:.3g} (rtol={rtol:g}, atol={atol:g})"


def _grad_l1(model: nn.Module) -> float:
    """``sum |g|`` over ``model``'s gradients: how far, to first order, its loss moves per
    unit of weight difference."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return sum(_full(g).detach().double().abs().sum().item() for g in grads)


def _loss_problems(
    losses: list[torch.Tensor],
    ref_losses: list[torch.Tensor],
    tolerances: Tolerances,
    reductions: int,
    diffs: ParityDiffs,
    slack: float = 0.0,
) -> list[str]:
    compare = _Comparison(tolerances, reductions, diffs, slack)
    problems = []
    for microbatch, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        mismatch = compare(_full(loss), _full(ref_loss), "loss")
        if mismatch:
            problems.append(
                f"loss of microbatch {microbatch} on rank {dist.get_rank()}: "
                f"{_full(loss).item():.6g} vs reference {_full(ref_loss).item():.6g}, {mismatch}"
            )
    return problems


def _forward_backward(
    model: nn.Module,
    inputs: list[Any],
    loss_fn: Callable[[Any], torch.Tensor],
    no_sync: Callable[[nn.Module], AbstractContextManager[Any]] | None,
) -> list[torch.Tensor]:
    """Forward and backward once per microbatch; all but the last inside ``no_sync``."""
    losses = []
    for microbatch, microbatch_inputs in enumerate(inputs):
        is_last = microbatch == len(inputs) - 1
        context = (
            no_sync(model) if no_sync is not None and not is_last else contextlib.nullcontext()
        )
        with context:
            loss = loss_fn(_call(model, microbatch_inputs))
            loss.backward()
        losses.append(loss.detach())
    return losses


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _agree_and_report(
    test_case: unittest.TestCase | None,
    stage: str,
    problems: list[str],
    hint: str = "",
    share: float = 0.0,
) -> float:
    """Fail on every rank if any rank has problems; see [Note: ranks agree on the verdict].

    ``stage`` names the check (``"check_train_parity, step 0 after backward"``) and starts
    the failure message on every rank; ``hint``, when given, ends it on every rank (what
    the failure likely means and how to fix it). Returns the largest ``share`` of any rank,
    agreed in the same all-reduce as the verdict.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # [failed flag of each rank | share of each rank]: each rank fills its own two slots
    agreed = torch.zeros(2 * world_size, dtype=torch.float64, device=_flag_device())
    agreed[rank] = float(bool(problems))
    agreed[world_size + rank] = share
    dist.all_reduce(agreed)
    failed_ranks = agreed[:world_size].nonzero().flatten().tolist()
    if not failed_ranks:
        return agreed[world_size:].max().item()
    if problems:
        shown = problems[:_MAX_REPORTED_PROBLEMS]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        message = f"{stage}: parity check failed on rank {rank}:\n  " + "\n  ".join(shown)
    else:
        message = f"{stage}: parity check failed on rank(s) {failed_ranks}; rank {rank} matched"
    if hint:
        message += f"\n  Likely cause: {hint}"
    _fail(test_case, message)


def _fail(test_case: unittest.TestCase | None, message: str) -> None:
    if test_case is not None:
        test_case.fail(message)
    raise AssertionError(message)


def _dropout_hint(ref_model: nn.Module) -> str:
    """For a loss that differs at step 0: the model's dropout draws different masks."""
    dropout = preflight.active_dropout(ref_model)
    if not dropout:
        return ""
    shown = ", ".join(dropout[:4]) + (", ..." if len(dropout) > 4 else "")
    return (
        f"the model has dropout in training mode ({shown}); the reference and the sharded "
        "model draw different random masks. Set the dropout probabilities to 0 (e.g. in the "
        "model's config) for a parity test"
    )


def _check_count_keys(expected_counts: Mapping[str, float] | None) -> None:
    if expected_counts is None:
        return
    unknown = sorted(set(expected_counts) - set(COUNT_KEYS))
    if unknown:
        raise ValueError(
            f"expected_counts has unknown key(s) {unknown}; the keys are {list(COUNT_KEYS)} "
            "(what reffsdp.testing.expected_counts returns)"
        )


def _counting(tally: CommTally, expected_counts: Mapping[str, float] | None):
    """Count this rank's reffsdp collectives into ``tally`` when counts are expected."""
    if expected_counts is None:
        return contextlib.nullcontext()
    return observe_collectives(tally.observe)


def _count_problems(tally: CommTally, expected_counts: Mapping[str, float]) -> list[str]:
    counts, _ = tally.per_step(1)
    wrong = [
        f"{key} {counts[key]:g}, expected {want:g}"
        for key, want in expected_counts.items()
        if counts[key] != want
    ]
    if not wrong:
        return []
    return [
        f"reffsdp's collectives on rank {dist.get_rank()}: " + "; ".join(wrong) + " (a group "
        "sharded or wrapped differently than expected, a missing prefetch, or a reduction "
        "too many)"
    ]


def _flag_device() -> torch.device:
    """Where the verdict tensor lives: NCCL only moves CUDA tensors, the rest take CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensor losses (e.g. from loss parallelism) are gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _name_mismatch(names: list[str], ref_names: list[str]) -> str:
    """The first position where the (prefix-stripped) names differ from the reference's."""
    for position, (name, ref_name) in enumerate(zip(names, ref_names)):
        if name != ref_name:
            return f"parameter names differ at position {position}: {name!r} vs {ref_name!r}"
    return f"{len(names)} parameters, but the reference has {len(ref_names)}"


def _strip_prefixes(name: str, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        name = name.replace(prefix, "")
    return name


def _none_or_set(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else "set"


# -- the wrapper API: original parameters rebuilt from flat shards -------------------------

_WRAPPED_MODULE = "_fsdp_wrapped_module."


# [Note: unflattening for a check]
# Each instance's flat parameter is sharded over its shard group (one rank for NO_SHARD,
# the intra-replica group for the hybrid strategies). Its local shards, and the flat
# gradient shards (``FlatParameter.grad``, or with ``use_orig_params=True`` the sharded
# 1-D gradient of each original parameter put back at its offset in the shard), are
# all-gathered with a plain ``dist.all_gather`` (not through reffsdp's collectives, so a
# bug planted there does not reach the checker) and cut into the original parameters by
# the flat layout. A gradient is ``None`` when it is ``None`` on every rank of the shard
# group. Names are the original ones: ``_fsdp_wrapped_module.`` and each of
# ``prefixes_to_ignore`` are removed. Parameters the wrapper does not flatten (ignored
# ones) are taken as they are. Every rank must call this together.
#
# This reads reffsdp's internals (its flat layout and shard group), and only reffsdp's
# classes go this way; another implementation's wrapper is read through its public API
# (:func:`summoned_params`). reffsdp's own ``summon_full_params`` would work here too,
# but it gathers through the members and collectives the self-test plants bugs in (the
# stale shard patches the members' all-gather input, which it uses as the forward's
# all-gather does): what the checker saw would then pass through the bug it is to
# catch. A plain ``dist.all_gather`` of the shards shares nothing with the code under
# test.


def unflattened_params(
    model: nn.Module, prefixes_to_ignore: Sequence[str] = ()
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``{name: (full parameter, full gradient or None)}`` of a model wrapped with
    ``reffsdp.FullyShardedDataParallel``, or ``None`` if it holds no wrapper instance.

    See [Note: unflattening for a check].
    """
    from reffsdp import FlatParameter
    from reffsdp.wrapper.state import state_of

    instances = [
        (path, state)
        for path, module in model.named_modules()
        if (state := state_of(module)) is not None
    ]
    if not instances:
        return None
    prefixes = (_WRAPPED_MODULE, *prefixes_to_ignore)
    entries: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    flattened: set[int] = set()
    for path, instance in instances:
        handle = instance.handle
        if handle is None:
            continue
        flattened.update(id(p) for p in handle.orig_params)
        prefix = f"{path}.{_WRAPPED_MODULE}" if path else _WRAPPED_MODULE
        group = instance.mesh_info.shard_group
        for fqn, param, grad in _unflatten_handle(handle, group):
            entries[_strip_prefixes(prefix + fqn, prefixes)] = (param, grad)
    for name, param in model.named_parameters():
        if isinstance(param, FlatParameter) or id(param) in flattened:
            continue
        entries.setdefault(_strip_prefixes(name, prefixes), (param, param.grad))
    return entries


def _unflatten_handle(
    handle: Any, group: dist.ProcessGroup | None
) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    layout = handle.layout
    shard = handle.local_shard.detach()
    grad_shard, has_grad = _flat_grad_shard(handle)
    flags = torch.tensor(has_grad, dtype=torch.float32, device=_flag_device())
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    flat = _gather_flat(shard, group)
    flat_grad = _gather_flat(grad_shard, group)
    found = []
    for i, fqn in enumerate(handle.fqns):
        start, numel, shape = layout.param_offsets[i], layout.numels[i], layout.shapes[i]
        param = flat.narrow(0, start, numel).view(shape)
        grad = flat_grad.narrow(0, start, numel).view(shape) if flags[i].item() else None
        found.append((fqn, param, grad))
    return found


def _flat_grad_shard(handle: Any) -> tuple[torch.Tensor, list[bool]]:
    """This rank's flat gradient shard (zeros where there is none) and, per parameter,
    whether this rank holds a gradient for it."""
    num_params = len(handle.fqns)
    shard = handle.local_shard.detach()
    if not handle.use_orig_params:
        grad = handle.flat_param.grad
        if grad is None:
            return torch.zeros_like(shard), [False] * num_params
        return grad.detach().to(shard.device), [True] * num_params
    flat_grad = torch.zeros_like(shard)
    has_grad = []
    for param, piece in zip(handle.orig_params, handle.rank_shard.params):
        has_grad.append(param.grad is not None)
        if param.grad is not None and piece.in_shard and piece.numel_in_shard:
            start = piece.offset_in_shard
            flat_grad[start : start + piece.numel_in_shard].copy_(param.grad.reshape(-1))
    return flat_grad, has_grad


def _gather_flat(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return shard.clone()
    chunks = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, shard.contiguous(), group=group)
    return torch.cat(chunks)


def _unflattened_problems(
    ref_model: nn.Module,
    unflattened: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    compare: _Comparison,
) -> list[str]:
    # Activation checkpointing's wrapper prefix goes on either side (see summoned_params).
    ref_named = {
        name.replace(_CHECKPOINT_WRAPPED, ""): param for name, param in ref_model.named_parameters()
    }
    unflattened = {name.replace(_CHECKPOINT_WRAPPED, ""): v for name, v in unflattened.items()}
    if sorted(unflattened) != sorted(ref_named):
        return [
            f"parameter names differ: {sorted(set(unflattened) - set(ref_named))} only in the "
            f"sharded model, {sorted(set(ref_named) - set(unflattened))} only in the reference"
        ]
    problems = []
    where = f"on rank {dist.get_rank()}"
    for name, ref_param in ref_named.items():
        param, grad = unflattened[name]
        mismatch = compare(param.detach(), ref_param.detach(), "param")
        if mismatch:
            problems.append(f"param {name!r} {where}: {mismatch}")
        if ref_param.grad is None or grad is None:
            if (ref_param.grad is None) != (grad is None):
                problems.append(
                    f"grad of {name!r} {where}: {_none_or_set(grad)} but the reference's is "
                    f"{_none_or_set(ref_param.grad)}"
                )
            continue
        mismatch = compare(grad.detach(), ref_param.grad.detach(), "grad")
        if mismatch:
            problems.append(f"grad of {name!r} {where}: {mismatch}")
    return problems


# -- another implementation's wrapper: full parameters through its summon_full_params -----

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."
_FLAT_PARAM = "_flat_param"


def is_wrapper_instance(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` instance, whoever implemented
    it: its class has ``summon_full_params`` and it holds a ``_fsdp_wrapped_module``."""
    summon = getattr(type(module), "summon_full_params", None)
    return callable(summon) and _WRAPPED_MODULE.rstrip(".") in registered_children(module)


# [Note: another implementation's wrapper]
# The checker knows nothing of another wrapper's internals, only the API both wrappers
# share: ``type(instance).summon_full_params(model, ...)``, a classmethod that makes
# every instance in ``model`` show its original parameters whole, and the names of the
# parameters it shows. Those are cloned inside the context and compared as reffsdp's
# unflattened ones are. Gradients:
#
# * with ``use_orig_params=True`` the same call with ``with_grads=True`` shows them;
# * with flat parameters it refuses ``with_grads`` (torch's does), but a flat gradient
#   shard has its flat parameter's layout, being its gradient. So each flat parameter's
#   shard is saved, overwritten with its gradient (zeros where it has none) and
#   summoned: the original parameters then show the gradients, cut and unpadded by the
#   implementation itself. The shards are put back in a ``finally``, bit for bit. A
#   gradient is ``None`` when its flat parameter's is ``None`` on every rank.
#
# Flat parameters are told by their name, ``_flat_param``, as both wrappers call it; the
# others are taken as they are (ignored parameters, a root left unwrapped). Names lose
# ``_fsdp_wrapped_module.`` and each of ``prefixes_to_ignore``. Unlike reffsdp's private
# path (see [Note: unflattening for a check]) this shows whatever the implementation's
# own all-gather returns, so a bug in it could shape the checker's view too; the losses,
# computed from that all-gather's output in every forward, still catch a wrong one.
# Every rank must call this together.


def summoned_params(
    model: nn.Module, prefixes_to_ignore: Sequence[str] = ()
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``{name: (full parameter, full gradient or None)}`` of a model that holds
    ``FullyShardedDataParallel`` instances of another implementation than reffsdp (torch's),
    read through that implementation's public API; ``None`` if it holds none.

    See [Note: another implementation's wrapper].
    """
    wrappers = [module for module in model.modules() if is_wrapper_instance(module)]
    if not wrappers:
        return None
    summon = type(wrappers[0]).summon_full_params
    prefixes = (_WRAPPED_MODULE, *prefixes_to_ignore)
    flat = [
        (_strip_prefixes(name, prefixes), param)
        for name, param in model.named_parameters()
        if name.rsplit(".", 1)[-1] == _FLAT_PARAM
    ]
    if not flat:
        with summon(model, writeback=False, with_grads=True):
            return {
                _strip_prefixes(name, prefixes): (param.detach().clone(), _clone(param.grad))
                for name, param in model.named_parameters()
            }
    outside = {  # parameters no flat parameter holds, e.g. ignored ones
        _strip_prefixes(name, prefixes): (param.detach().clone(), _clone(param.grad))
        for name, param in model.named_parameters()
        if name.rsplit(".", 1)[-1] != _FLAT_PARAM
    }
    has_grad = [param.grad is not None for _, param in flat]
    flags = torch.tensor(has_grad, dtype=torch.float32, device=_flag_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    params = _summoned(summon, model, prefixes)
    grads = _summoned_flat_grads(summon, model, prefixes, [param for _, param in flat])
    owners = [name[: -len(_FLAT_PARAM)] for name, _ in flat]  # module paths, "" or "0."
    entries: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, value in params.items():
        if name in outside:
            entries[name] = outside[name]
            continue
        owner = max(  # the innermost instance whose module holds the parameter
            (i for i, path in enumerate(owners) if name.startswith(path)),
            key=lambda i: len(owners[i]),
        )
        entries[name] = (value, grads[name] if flags[owner].item() else None)
    return entries


def _summoned(summon: Callable, model: nn.Module, prefixes: Sequence[str]) -> dict:
    """``{name: full value}`` of every parameter ``summon(model)`` shows, cloned."""
    with summon(model, writeback=False):
        return {
            _strip_prefixes(name, prefixes): param.detach().clone()
            for name, param in model.named_parameters()
            if name.rsplit(".", 1)[-1] != _FLAT_PARAM
        }


def _summoned_flat_grads(
    summon: Callable, model: nn.Module, prefixes: Sequence[str], flat: list[nn.Parameter]
) -> dict:
    """The flat parameters' gradients, summoned in their place; see
    [Note: another implementation's wrapper]."""
    kept = [param.detach().clone() for param in flat]
    try:
        with torch.no_grad():
            for param in flat:
                if param.grad is None:
                    param.zero_()
                else:
                    param.copy_(param.grad)
        return _summoned(summon, model, prefixes)
    finally:
        with torch.no_grad():
            for param, value in zip(flat, kept):
                param.copy_(value)


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


# -- reffsdp.naive: parameters gathered whole from their slices -----------------------------


def naive_params(
    model: nn.Module, prefixes_to_ignore: Sequence[str] = ()
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``{name: (full parameter, full gradient or None)}`` of a ``reffsdp.naive.NaiveFSDP``,
    or ``None`` for any other model.

    Each slice (and its gradient, zeros on a rank that has none) is gathered with a plain
    ``dist.all_gather``, not through reffsdp's collectives, so that a bug planted there does
    not reach the checker; the padding is dropped and the shape restored. A gradient is
    ``None`` when it is ``None`` on every rank. Every rank must call this together.
    """
    from reffsdp.naive import NaiveFSDP

    if not isinstance(model, NaiveFSDP):
        return None
    has_grad = [naive.shard.grad is not None for naive in model.sharded.values()]
    flags = torch.tensor(has_grad, dtype=torch.float32, device=_flag_device())
    if model.world_size > 1 and flags.numel():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=model.group)
    entries: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for (name, naive), flag in zip(model.sharded.items(), flags.tolist()):
        shard = naive.shard.detach()
        grad = None
        if flag:
            local = torch.zeros_like(shard) if naive.shard.grad is None else naive.shard.grad
            grad = _gather_whole(local.detach(), naive.shape, model.group)
        param = _gather_whole(shard, naive.shape, model.group)
        entries[_strip_prefixes(name, prefixes_to_ignore)] = (param, grad)
    return entries


def _gather_whole(
    shard: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup | None
) -> torch.Tensor:
    return _gather_flat(shard, group)[: shape.numel()].view(shape)
