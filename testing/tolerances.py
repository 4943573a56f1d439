"""How far a sharded model may drift from its reference before a parity check fails.

[Note: default tolerances]
Sharded training and its ``DistributedDataParallel`` reference add up the same numbers in
different orders, and floating-point addition is not associative, so their gradients differ
in the last bits. How many bits depends on three things: the dtype, how many terms are
summed, and the shape of the tree that sums them. The default tolerance is derived from
them; it is not a fixed number that a larger world or a larger loss outgrows.

1. One rounding: every addition or scaling rounds to the nearest representable value, an
   error of at most ``u = eps / 2`` relative to the result (``eps = torch.finfo(dtype).eps``:
   ``1.19e-7`` for fp32, ``7.81e-3`` for bf16).
2. One reduction: each gradient element averages the W ranks' local gradients
   ``g_1 .. g_W``. Summed along a tree where a term passes through at most ``d`` additions,
   the result is within ``d * u * sum(|g_i|)`` of the exact sum. DDP's all-reduce over W
   ranks has ``d <= W - 1`` (a ring or a chain carries the first term through every
   addition). FSDP reduce-scatters over the S ranks of a shard group and, for HSDP, then
   all-reduces the shard over the R replicas: ``d <= (S - 1) + (R - 1)``, again at most
   ``W - 1`` since ``S * R = W``; a checker that may meet any tree takes ``W - 1`` for it.
   Averaging scales once or twice on each side (``AVG``, or a pre- and a post-divide
   factor): up to 4 more roundings. Accumulating M microbatches adds ``M - 1`` additions
   on each side. So one reduction's results differ by at most ``n * u * mean(|g_i|)``, with

       n = 2 (W - 1) + 2 (M - 1) + 4

3. The scale: ``mean(|g_i|)`` is gone once the gradients are reduced, so the checker takes
   the largest magnitude of the reference tensor in its place, and allows ``n * eps``
   times it (twice the bound of 2: the ranks' terms can be larger than their average
   when they cancel). The comparison is normwise, ``max |actual - expected| <= tol *
   max |expected|``, which also covers an element that cancels to nearly zero: its
   rounding error is set by the size of the terms, not by the small result.
4. Training compounds: a step's update carries that step's rounding into the weights, and
   the next forward and backward start from weights that already differ, which the step
   can stretch further. The allowance doubles with every reduction a value can have seen:
   ``2 ** k`` times the tolerance of 3, with ``k = s + 1`` for the gradients and weights
   of step ``s`` and ``k = max(s, 1)`` for its loss (a check that starts from weights
   trained apart before, as after reloading a checkpoint, gets one reduction's allowance at
   its first step). Measured on GPT-2 and Llama over 4 threaded ranks (cross-entropy, and
   a plain sum of logits whose training runs away), the largest difference reached about
   half of it. The doubling stops at ``k = 6`` (64 times point 3): beyond that a longer
   run would loosen the check until it could no longer fail (fp32 at 4 ranks allows
   ``7.6e-5`` of the largest magnitude then, still far below a wrong divide factor); a run
   whose differences keep growing past it needs a tolerance of its own.

5. A loss compares two forwards from weights that already differ, by no more than the
   weight checks accepted. To first order the loss then moves by ``sum_i g_i dw_i``, at most
   ``||g||_1 * max |dw|``, which its own magnitude does not bound: a loss that sums large
   terms that cancel (a plain sum of outputs going from 60 at step 0 to -0.94 at step 1, on
   a tied-weight MLP over HSDP) differs by ``4e-6`` where point 4 allows ``2.2e-6``, while
   its weights differ by ``1.5e-8`` and ``||g||_1`` is 1300. So a loss may also differ by
   ``2 * ||g_ref||_1 * max |dw|``: ``g_ref`` is the reference's gradient of that step
   (averaged over the ranks by DDP; the factor 2 covers a rank's own gradient being larger
   than the average) and ``max |dw|`` the largest weight difference any rank has seen so
   far. It grows only with differences the checks have already accepted, and is zero at
   step 0, where both models start from the same weights.

6. Mixed precision. ``eps`` above is that of the dtype compared, unless the sharded model
   reduces its gradients in a dtype of less precision: then it is the reduce dtype's. The
   reduce dtype is the one the model *declares*, read from its FSDP modules whoever
   implemented them (:func:`declared_mixed_precision`): the policy's ``reduce_dtype``, or
   when unset the dtype the API falls back to, ``param_dtype`` for the wrapper and, for
   ``fully_shard``, the compute dtype up to torch 2.14 and the parameter's own from 2.15
   (entry 5 of [Note: torch versions] in ``reffsdp/core/compat.py``).

   a. The reduce dtype's rounding. Each rank's gradient ``g_i`` is cast to the reduce
      dtype (an error of at most ``u_r |g_i|``, ``u_r = eps_r / 2``), summed in it along
      the tree (``W - 1`` roundings), scaled (2) and accumulated over microbatches
      (``M - 1``), then cast back exactly; DDP does the same in fp32, whose roundings are
      ``2 ** 16`` (bf16) or ``2 ** 13`` (fp16) times smaller. Relative to
      ``mean(|g_i|)`` as in point 2 that is at most ``(W + M + 1) * u_r``, below
      ``n * u_r`` for every ``W`` and ``M`` (``n - (W + M + 1) = W + M - 1 >= 1``), so
      point 2's ``n`` with ``eps_r`` in place of ``eps`` bounds it, with room for the
      reference's fp32 roundings. Below the reduce dtype's smallest normal number a
      rounding is absolute, up to half its smallest subnormal (``3e-8`` for fp16,
      ``5e-41`` for bf16), so the default ``atol`` also adds ``2 ** k * n`` smallest
      subnormals: it matters only for fp16 gradients under ``6e-5``.
   b. An fp32-asked reduction done in bf16 still fails. The tolerance follows what the
      model asked for, never what it did: a gradient reduced in bf16 carries errors of
      ``u_bf16 = 3.9e-3`` of its magnitude from the cast alone, while the fp32 default of
      step 0 allows ``2 * n * eps_fp32``, ``1.4e-6`` at 2 ranks and ``2.4e-6`` at 4, over
      a thousand times less. Reading the dtype reffsdp reduced in (its group's reduce
      step) would widen the tolerance with the bug, and the self-test's "mixed-precision
      reduce in the wrong dtype" would pass.
   c. What the param dtype adds: nothing beyond being the reduce dtype's fallback. A
      parity check of a model that computes in ``param_dtype`` compares it with a
      reference that computes in the same dtype
      (:class:`~reffsdp.testing.parity.LowPrecisionCompute`): at step 0 both cast the same
      fp32 weights to the same low-precision values and compute the same forward and
      backward, so each rank's local gradients are the same numbers on both sides and
      only the reductions differ, as in a. After a step the fp32 weights differ by the
      drift ``dw`` the checks accepted, and their casts agree except where a rounding
      boundary of ``param_dtype`` lies between the two: a whole step of that dtype, like
      an fp8 code flip (point c of [Note: quantized weights]), rare, the same on every
      run, and remedied by another seed. A reference that computes in fp32 next to a
      model that computes in bf16 differs by bf16 roundings of every operation, set by
      the model's depth rather than by any reduction; no default derives that, so give
      it ``rtol``/``atol``.
   d. One tolerance for the whole model: a loss depends on every parameter, so the model's
      reduce dtype is the one of least precision over its FSDP modules
      (:func:`model_reduce_dtype`). ``param_dtype_override_fn`` can only keep a parameter
      in its own dtype instead of ``param_dtype``; the checker does not call it again and
      takes ``param_dtype`` for each module that declares one, so a module whose every
      parameter is overridden is held to ``param_dtype``'s tolerance, wider than needed.

   The allowance grows with the steps as in point 4, so a bf16 reduction's check is as
   sharp as its first steps: at 4 ranks step 0 allows ``2 * 10 * 7.8e-3``, 16% of a
   gradient's largest magnitude, enough for a wrong divide factor; a bug smaller than
   that shows only under an fp32 reduction. Measured (``MLPStack(16)``, 5 steps, threaded
   ranks, ``reduce_dtype`` alone set): the largest difference reached 6% of its allowance
   on 2 ranks in bf16, 20% on 4 ranks in bf16 and 4% on 4 ranks in fp16; torch's
   ``fully_shard`` and both wrappers differ from DDP by the same numbers as reffsdp's
   ``fully_shard``.

So the default is ``2 ** min(k, 6) * n * eps * max |expected|``, plus point 5's allowance
for a loss (and point 6a's subnormals for a narrower reduce dtype).

Worked example: W = 4 ranks, fp32, one microbatch, HSDP over 2 replicas of 2-rank shard
groups. DDP sums a gradient element of the four ranks as ``((g1 + g2) + g3) + g4``
(``d = 3``); HSDP reduce-scatters within each shard group, ``g1 + g2`` and ``g3 + g4``
(one addition each), then all-reduces across the replicas, ``(g1 + g2) + (g3 + g4)``
(``d = 1 + 1 = 2 <= 3``). ``n = 2 * 3 + 0 + 4 = 10``, so the gradients of step 0 may
differ by ``2 * 10 * 1.19e-7 = 2.4e-6`` of the tensor's largest magnitude, those of step
2 by ``8 * 10 * 1.19e-7 = 9.5e-6``. A gradient whose largest element is 20 may differ by
``4.8e-5`` at step 0 and ``1.9e-4`` at step 2, where a fixed ``atol=1e-5`` (with
``rtol=1.3e-6``) fails an element of 8 that differs by ``2.3e-5``, within the rounding the
reduction itself makes. A wrong divide factor (a factor 2) or a gradient reduced in bf16
where fp32 was asked for (``3.9e-3`` relative) is still hundreds of times over it.

What this does not cover: an optimizer that divides by a running gradient magnitude
(Adam's ``sqrt(v)``) turns the rounding noise of a gradient element near zero into an
update of up to ``lr`` (give it an ``atol`` of that order), and a loss that grows without
bound while training (a plain sum of logits) amplifies every difference step after step
(use a bounded loss, e.g. the model's cross-entropy).

A tolerance the caller gives (``rtol``/``atol``, one number for every dtype or a mapping
from dtype to number) replaces this for the dtypes it names, and is applied elementwise as
``torch.allclose`` does: ``|actual - expected| <= atol + rtol * |expected|``.

[Note: quantized weights]
The ``fp8-gather`` scenarios shard weights that all-gather as fp8
(:class:`~reffsdp.testing.low_precision.Float8GatherWeight`): the sharded model computes
with ``q(w)``, its weight quantized to fp8 row by row and dequantized to fp32, while its
DDP reference (:class:`~reffsdp.testing.low_precision.Float8GatherReference`) computes with
``w + (q(w) - w).detach()`` of its own fp32 weight. fp8 keeps 3 mantissa bits, an error of
up to 1/16 of an element, yet the fp32 default above holds unchanged, with no fp8 term:

a. Equal weights quantize to the same bits. A scale belongs to a row and dim-0 sharding
   never splits a row, so a rank's shard quantizes as that part of the whole weight does;
   and ``w + (q(w) - w)`` is ``q(w)`` exactly, since ``q(w)`` is within a factor 2 of ``w``
   (or 0) and so ``q(w) - w`` is exact (Sterbenz's lemma). At step 0 both models start
   from the same weights and compute the same forward on each rank, as in fp32.
b. The gradient passes straight through on both sides. The sharded model's gradient is
   that of the dequantized weight, a leaf; the reference's passes ``w + c`` unchanged. So
   each rank's local gradients are the same numbers, and the reductions differ only as in
   point 2 above.
c. After a step the weights differ by the drift ``dw`` the weight checks accepted. With
   the same fp8 codes, two weights' quantized values differ by at most ``dw`` (a code of
   at most 448 times a scale that moved by at most ``dw / 448``): within the drift fp32
   training already carries. The codes differ only where a rounding boundary of fp8 lies
   between the two weights; there the quantized values differ by a whole fp8 step, at
   least 1/16 of the element, as large as the bugs the checks are for, so no tolerance
   covers it. The chance is about ``2 dw / step`` per element and step. ``dw`` is at
   most ``1e-8`` in the suite (plain SGD's ``lr = 1e-3`` times rounding-sized gradient
   differences; most elements drift far less), and an element of order 0.1 has steps of
   about ``1e-2``: ``2e-6``. Elements below ``amax / 448 / 64`` of their row's largest
   magnitude are fp8 subnormals, with steps of ``amax / 448 / 512``, so chances thousands
   of times larger, but they are a few in ``10**5`` of the suite's weights. Over a
   scenario's few thousand quantized elements and 3 steps the chance of any flip is
   around 1 in 100 at most, with every element at the largest drift. A run is
   deterministic: the suite's seeds meet none, a seed that met one would fail every
   time, and its remedy is another seed, not a wider tolerance.

Measured (4 threaded ranks, 3 steps, torch's ``fully_shard`` in reffsdp's place, as
``test_the_fp8_gather_scenarios_pass_under_torchs_fully_shard...`` runs them): the 1-D MLP
matches its reference bit for bit; the HSDP transformer's largest differences are
``9.5e-7`` (loss and gradients, allowed ``1.4e-4``) and ``1.5e-8`` (weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from reffsdp.core.compat import fully_shard_default_reduce_dtype
from reffsdp.core.torch_internals import registered_children

# One number for every dtype, or one per dtype; None: the derived default.
Tolerance = float | Mapping[torch.dtype, float] | None

_SCALINGS_PER_SIDE = 2  # AVG, or a pre-divide and a post-divide factor
MAX_DOUBLINGS = 6  # point 4 of the note: the allowance grows no further


def reduction_roundings(world_size: int, num_microbatches: int = 1) -> int:
    """``n`` of [Note: default tolerances]: the roundings by which one reduction of the
    sharded model and one of the reference can differ.

    >>> reduction_roundings(4)  # DDP's and any FSDP tree over 4 ranks: 3 + 3, plus 4 scalings
    10
    >>> reduction_roundings(4, num_microbatches=2)
    12
    """
    if world_size < 1 or num_microbatches < 1:
        raise ValueError(
            f"world_size and num_microbatches must be at least 1, got {world_size} and "
            f"{num_microbatches}"
        )
    return 2 * (world_size - 1) + 2 * (num_microbatches - 1) + 2 * _SCALINGS_PER_SIDE


def default_tolerance(
    dtype: torch.dtype,
    world_size: int,
    num_microbatches: int = 1,
    reductions: int = 1,
    reduce_dtype: torch.dtype | None = None,
) -> float:
    """The normwise tolerance of [Note: default tolerances]: ``2 ** reductions * n * eps``
    (``reductions`` from 1 to ``MAX_DOUBLINGS``), with ``eps`` that of ``dtype`` or of
    ``reduce_dtype``, whichever has less precision (point 6).

    >>> f"{default_tolerance(torch.float32, 4):.3g}"  # the gradients of step 0
    '2.38e-06'
    >>> f"{default_tolerance(torch.float32, 4, reductions=3):.3g}"  # those of step 2
    '9.54e-06'
    >>> default_tolerance(torch.float32, 4, reductions=50) == default_tolerance(
    ...     torch.float32, 4, reductions=6)  # a long run keeps step 5's allowance
    True
    >>> f"{default_tolerance(torch.float32, 4, reduce_dtype=torch.bfloat16):.3g}"  # 2*10*2**-7
    '0.156'
    """
    if not dtype.is_floating_point:
        return 0.0
    eps = torch.finfo(_least_precise(dtype, reduce_dtype)).eps
    return _growth(reductions) * reduction_roundings(world_size, num_microbatches) * eps


def subnormal_floor(
    dtype: torch.dtype,
    world_size: int,
    num_microbatches: int = 1,
    reductions: int = 1,
    reduce_dtype: torch.dtype | None = None,
) -> float:
    """The absolute part of the default (point 6a of [Note: default tolerances]):
    ``2 ** reductions * n`` smallest subnormals of ``reduce_dtype`` when it has less
    precision than ``dtype``, else 0.

    >>> f"{subnormal_floor(torch.float32, 2, reduce_dtype=torch.float16):.3g}"  # 2*6*2**-24
    '7.15e-07'
    >>> subnormal_floor(torch.float32, 2, reduce_dtype=torch.float32)
    0.0
    """
    if not dtype.is_floating_point or _least_precise(dtype, reduce_dtype) == dtype:
        return 0.0
    info = torch.finfo(reduce_dtype)
    smallest_subnormal = info.smallest_normal * info.eps
    growth = _growth(reductions)
    return growth * reduction_roundings(world_size, num_microbatches) * smallest_subnormal


def _growth(reductions: int) -> int:
    return 2 ** min(max(reductions, 1), MAX_DOUBLINGS)  # point 4 of the note


def _least_precise(dtype: torch.dtype, other: torch.dtype | None) -> torch.dtype:
    """``other`` if it is a floating dtype with a larger epsilon than ``dtype``'s, else
    ``dtype``."""
    if other is None or not other.is_floating_point:
        return dtype
    return other if torch.finfo(other).eps > torch.finfo(dtype).eps else dtype


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """What a parity check holds one comparison to.

    ``rtol``/``atol`` are the caller's (see :data:`Tolerance`); where they name no value for
    a dtype, the default of [Note: default tolerances] for ``world_size`` ranks and
    ``num_microbatches`` applies, widened to ``reduce_dtype``'s precision where that has
    less (the sharded model's, :func:`model_reduce_dtype`; point 6 of the note).
    """

    rtol: Tolerance = None
    atol: Tolerance = None
    world_size: int = 1
    num_microbatches: int = 1
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            values = value.values() if isinstance(value, Mapping) else [value]
            if any(v is not None and v < 0 for v in values):
                raise ValueError(f"{name} must not be negative, got {value}")

    def given(self, dtype: torch.dtype) -> tuple[float, float] | None:
        """The caller's ``(rtol, atol)`` for ``dtype``, or ``None`` if they named neither.

        Like ``torch.testing.assert_close``, both or neither: one alone is refused.
        """
        rtol, atol = _pick(self.rtol, dtype), _pick(self.atol, dtype)
        if rtol is None and atol is None:
            return None
        if rtol is None or atol is None:
            missing = "rtol" if rtol is None else "atol"
            raise ValueError(
                f"a tolerance for {dtype} needs both rtol and atol, got no {missing}; "
                "give both (0 is allowed), or neither for the derived default"
            )
        return rtol, atol

    def for_comparison(
        self, expected: torch.Tensor, scale: torch.Tensor | None, reductions: int
    ) -> tuple[float, float]:
        """``(rtol, atol)`` for comparing a tensor with ``expected``.

        ``scale`` is the whole reference tensor when ``expected`` is one rank's piece of it
        (its largest magnitude sets the default's scale on every rank); ``reductions``
        counts the reductions whose rounding can have reached the values (point 4 of the
        note).
        """
        given = self.given(expected.dtype)
        if given is not None:
            return given
        whole = expected if scale is None else scale
        if not whole.is_floating_point() or not whole.numel():
            return 0.0, 0.0
        # Non-finite values must match exactly (NaN with NaN): they set no scale.
        magnitude = whole.detach().abs().nan_to_num(0.0, 0.0, 0.0).max().item()
        how = (self.world_size, self.num_microbatches, reductions, self.reduce_dtype)
        tol = default_tolerance(expected.dtype, *how)
        return 0.0, tol * magnitude + subnormal_floor(expected.dtype, *how)


def _pick(value: Tolerance, dtype: torch.dtype) -> float | None:
    if isinstance(value, Mapping):
        return value.get(dtype)
    return value


# -- the sharded model's declared mixed precision (point 6 of the note) --------------------


def declared_mixed_precision(module: nn.Module) -> tuple[str, Any] | None:
    """The mixed-precision policy ``module`` was sharded with: ``("wrapper", policy)`` for
    a ``FullyShardedDataParallel`` instance, ``("fully_shard", policy)`` for a module
    ``fully_shard`` was called on, ``None`` for any other module.

    Read by duck typing, the same for reffsdp's classes and torch's (the parity checks'
    one read of a private attribute of torch's FSDP, kept here so that it can move):

    * a wrapper instance (a module with a ``_fsdp_wrapped_module`` child): its
      ``mixed_precision``, a ``MixedPrecision``; reffsdp's is a property over the
      instance's settings, torch's an attribute its constructor sets (both hold
      ``MixedPrecision()`` when none was given);
    * a ``fully_shard`` module (one with ``_get_fsdp_state()``): the state's policy, a
      ``MixedPrecisionPolicy``: ``mp_policy`` on reffsdp's ``FSDPState``, ``_mp_policy``
      (private) on torch's.
    """
    if "_fsdp_wrapped_module" in registered_children(module) and hasattr(module, "mixed_precision"):
        return "wrapper", module.mixed_precision
    get_state = getattr(module, "_get_fsdp_state", None)
    if callable(get_state):
        state = get_state()
        policy = getattr(state, "mp_policy", None) or getattr(state, "_mp_policy", None)
        if policy is not None:
            return "fully_shard", policy
    return None


def model_reduce_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of least precision that ``model``'s FSDP modules declare to reduce a
    gradient in, narrower than the gradient's own; ``None`` when every gradient is reduced
    in its own dtype (point 6 of [Note: default tolerances]).

    Unset, the reduce dtype falls back as each API does: the wrapper to ``param_dtype``,
    ``fully_shard`` to the compute dtype up to torch 2.14 and to the gradient's own dtype
    from 2.15 (:func:`reffsdp.core.compat.fully_shard_default_reduce_dtype`).
    """
    found: torch.dtype | None = None
    for module in model.modules():
        declared = declared_mixed_precision(module)
        if declared is None:
            continue
        api, policy = declared
        for param in module.parameters():
            if not param.is_floating_point():
                continue
            reduce_dtype = policy.reduce_dtype
            if reduce_dtype is None and api == "wrapper":
                reduce_dtype = policy.param_dtype
            elif reduce_dtype is None:
                reduce_dtype = fully_shard_default_reduce_dtype(policy.param_dtype, param.dtype)
            if _least_precise(param.dtype, reduce_dtype) != param.dtype:
                found = reduce_dtype if found is None else _least_precise(found, reduce_dtype)
    return found
