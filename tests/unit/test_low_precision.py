"""The fp8 all-gather weight of ``reffsdp.testing.low_precision``, in one process: its
quantization, its padding, both hook forms, an all-gather simulated by hand, its reference
and the optimizer's view of it."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

from reffsdp.testing.low_precision import (
    FP8,
    Float8GatherReference,
    Float8GatherWeight,
    Float8GatherWeightMeshOnly,
    float8_weight_names,
    quantize_dequantize,
    quantize_rows,
    straight_through,
    to_float8_gather,
)
from reffsdp.testing.models import MLPStack, init_deterministic


class ShardMesh:
    """What the hooks ask of the shard mesh: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _weight(rows: int = 15, cols: int = 5, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator)


def _pre_all_gather(shard: Float8GatherWeight, unsharded: torch.Tensor, shard_size: int):
    """Call the shard's hook in the form it declares, as FSDP does."""
    mesh = ShardMesh(shard_size)
    if len(inspect.signature(shard.fsdp_pre_all_gather).parameters) == 1:
        return shard.fsdp_pre_all_gather(mesh)
    stride = unsharded.stride()
    return shard.fsdp_pre_all_gather(mesh, unsharded.shape, stride, nn.Linear(1, 1), None)


def _all_gather_by_hand(weight: Float8GatherWeight, shard_size: int):
    """Every rank's hook inputs, concatenated along dim 0 as an all-gather returns them,
    and the metadata (the same on every rank)."""
    shards = list(weight.chunk(shard_size))
    shards += [weight[weight.shape[0] :]] * (shard_size - len(shards))  # ranks left empty
    sent = [_pre_all_gather(shard, weight, shard_size) for shard in shards]
    sizes = {tuple(tuple(t.shape) for t in inputs) for inputs, _ in sent}
    assert len(sizes) == 1, f"ranks send different shapes: {sizes}"
    outputs = tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in sent)))
    return outputs, sent[0][1]


# -- quantization ----------------------------------------------------------------------------


def test_a_round_trip_is_within_fp8s_rounding_of_each_row():
    weight = _weight(64, 32)
    back = quantize_dequantize(weight)
    assert back.dtype == torch.float32 and back.shape == weight.shape
    row_max = weight.abs().amax(dim=1, keepdim=True)
    # 3 mantissa bits: half a step is 1/16 of the value; near zero, subnormal steps of
    # 2^-9 of the row's scale (row_max / 448)
    bound = torch.maximum(weight.abs() / 16, row_max / 448 * 2.0**-10)
    assert ((back - weight).abs() <= bound * (1 + 1e-6)).all()
    assert (back != weight).any()  # it did quantize
    assert torch.equal(quantize_dequantize(back), back)  # fp8 values survive a second trip


def test_scales_are_per_row_so_any_dim_0_sharding_quantizes_alike():
    weight = _weight(15, 5)
    whole = quantize_rows(weight)
    for shard_size in (2, 3, 4, 15):
        pieces = [quantize_rows(chunk) for chunk in weight.chunk(shard_size)]
        assert torch.equal(torch.cat([p.scales for p in pieces]), whole.scales)
        data = torch.cat([p.data.view(torch.uint8) for p in pieces])
        assert torch.equal(data, whole.data.view(torch.uint8))


def test_zero_rows_get_a_safe_scale_and_a_rows_largest_magnitude_maps_to_448():
    weight = torch.tensor([[0.0, 0.0], [2.0, -1.0]])
    rows = quantize_rows(weight)
    assert torch.equal(rows.scales.flatten(), torch.tensor([1.0, 2.0 / 448]))
    assert rows.data.dtype == FP8 and rows.data.float().tolist() == [[0, 0], [448, -224]]
    assert torch.isfinite(rows.dequantize(torch.float32)).all()
    with pytest.raises(ValueError, match="2 or more dims"):
        quantize_rows(torch.ones(3))


def test_the_straight_through_weight_is_the_quantized_one_bit_for_bit_with_an_identity_grad():
    weight = torch.cat([_weight(32, 16), _weight(32, 16) * 1e-4])  # fp8 subnormals too
    weight[3, :4] = torch.tensor([0.0, 1e-30, -1e-30, 1e-38])
    weight.requires_grad_(True)
    value = straight_through(weight)
    assert torch.equal(value, quantize_dequantize(weight.detach()))
    upstream = torch.randn(weight.shape)
    value.backward(upstream)
    assert torch.equal(weight.grad, upstream)


# -- the subclass ----------------------------------------------------------------------------


def test_shards_views_and_copies_stay_float8_gather_weights_other_ops_give_plain_tensors():
    weight = Float8GatherWeight(_weight(15, 5))
    keep = {
        "chunk": weight.chunk(4)[3],
        "narrow": weight.narrow(0, 0, 3),
        "new_zeros": weight.new_zeros((4, 5)),
        "view": weight.view(-1),
        "detach": weight.detach(),
        "clone": weight.clone(),
        "to": weight.to(torch.float64),
        "empty_like": torch.empty_like(weight),
    }
    for name, tensor in keep.items():
        assert type(tensor) is Float8GatherWeight, name
        assert tensor.unsharded_rows == 15, name
    for tensor in (weight * 2, weight.sum(), weight @ torch.ones(5), weight - weight):
        assert type(tensor) is torch.Tensor
    assert type(Float8GatherWeightMeshOnly(_weight()).chunk(2)[0]) is Float8GatherWeightMeshOnly


def test_in_place_ops_write_the_fp32_value_and_return_the_weight_itself():
    weight = Float8GatherWeight(torch.zeros(2, 3))
    assert weight.add_(1.5) is weight
    assert weight.copy_(torch.full((2, 3), 2.0)) is weight
    assert torch.equal(weight._tensor, torch.full((2, 3), 2.0))
    padded = weight.new_zeros((4, 3))
    padded.narrow(0, 0, 2).copy_(weight)  # how FSDP fills a padded shard
    assert padded._tensor.tolist() == [[2.0] * 3] * 2 + [[0.0] * 3] * 2


def test_an_optimizer_step_updates_the_fp32_value_and_keeps_the_subclass():
    plain = nn.Parameter(_weight(6, 4))
    wrapped = nn.Parameter(Float8GatherWeight(plain.detach().clone()))
    assert type(wrapped) is Float8GatherWeight and wrapped.requires_grad
    optims = [torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in (plain, wrapped)]
    grad = _weight(6, 4, seed=1)
    for _ in range(2):
        for param, optim in zip((plain, wrapped), optims):
            param.grad = grad.clone()
            optim.step()
    assert type(wrapped) is Float8GatherWeight
    assert torch.equal(wrapped._tensor, plain.detach())
    assert torch.equal(copy.deepcopy(wrapped)._tensor, plain.detach())


# -- the hooks -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Float8GatherWeight, Float8GatherWeightMeshOnly])
def test_each_hook_form_declares_its_arguments(cls):
    weight = cls(_weight())
    expected = 5 if cls is Float8GatherWeight else 1
    assert len(inspect.signature(weight.fsdp_pre_all_gather).parameters) == expected
    post = inspect.signature(weight.fsdp_post_all_gather).parameters
    assert list(post) == ["all_gather_outputs", "metadata", "param_dtype", "out"]
    assert post["out"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("cls", [Float8GatherWeight, Float8GatherWeightMeshOnly])
@pytest.mark.parametrize("rows, shard_size", [(15, 4), (5, 4), (8, 2), (3, 1)])
def test_a_hand_made_all_gather_gives_the_whole_weight_quantized(cls, rows, shard_size):
    full = _weight(rows, 5)
    weight = cls(full.clone())
    outputs, metadata = _all_gather_by_hand(weight, shard_size)
    padded = -(-rows // shard_size) * shard_size
    assert [o.shape for o in outputs] == [(padded, 5), (padded, 1)]
    assert [o.dtype for o in outputs] == [FP8, torch.float32]
    assert (outputs[1][rows:] == 1).all() and (outputs[0][rows:].float() == 0).all()
    unsharded, to_free = weight.fsdp_post_all_gather(outputs, metadata, torch.float32)
    assert type(unsharded) is torch.Tensor and unsharded.shape == (rows, 5)
    assert torch.equal(unsharded, quantize_dequantize(full))
    assert to_free == (unsharded,)


@pytest.mark.parametrize("cls", [Float8GatherWeight, Float8GatherWeightMeshOnly])
def test_a_padded_rank_sends_the_padded_shape(cls):
    weight = cls(_weight(15, 5))
    last = weight.chunk(4)[3]  # 3 of 4 rows
    (data, scales), metadata = _pre_all_gather(last, weight, 4)
    assert data.shape == (4, 5) and scales.shape == (4, 1)
    assert scales[3].item() == 1.0 and data[3].float().abs().sum() == 0
    assert metadata == torch.Size((15, 5))


def test_a_refill_writes_out_in_place_and_keeps_its_version_for_autograd():
    weight = Float8GatherWeight(_weight(8, 5))
    outputs, metadata = _all_gather_by_hand(weight, 2)
    unsharded, _ = weight.fsdp_post_all_gather(outputs, metadata, torch.float32)
    param = nn.Parameter(unsharded)
    loss = (param * param).sum()  # autograd saves param: a refill must not bump its version
    version, storage = param._version, param.untyped_storage().data_ptr()
    weight._tensor.mul_(-1)  # the optimizer moved the weight
    outputs, metadata = _all_gather_by_hand(weight, 2)
    assert weight.fsdp_post_all_gather(outputs, metadata, torch.float32, out=param) is None
    assert param.untyped_storage().data_ptr() == storage and param._version == version
    assert torch.equal(param.detach(), quantize_dequantize(weight._tensor))
    loss.backward()  # would raise had the version moved
    assert param.grad is not None


def test_bf16_param_dtype_dequantizes_to_bf16():
    weight = Float8GatherWeight(_weight(4, 6))
    outputs, metadata = _all_gather_by_hand(weight, 2)
    unsharded, _ = weight.fsdp_post_all_gather(outputs, metadata, torch.bfloat16)
    assert unsharded.dtype == torch.bfloat16
    expected = quantize_rows(weight._tensor).dequantize(torch.bfloat16)
    assert torch.equal(unsharded, expected)


def test_wide_rows_send_about_a_quarter_of_fp32s_bytes():
    cols = 256
    weight = Float8GatherWeight(_weight(64, cols))
    (data, scales), _ = _pre_all_gather(weight.chunk(4)[0], weight, 4)
    sent = data.nbytes + scales.nbytes
    assert sent * 4 * cols == 16 * 4 * cols * (cols + 4)  # (C + 4) / (4 C) of fp32's
    assert 0.25 < sent / (16 * cols * 4) < 0.26


# -- converting a model, and its reference ----------------------------------------------------


def test_to_float8_gather_converts_linear_weights_only():
    model = init_deterministic(MLPStack(5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    names = to_float8_gather(model, hook_arguments=1)
    assert (
        names
        == float8_weight_names(model)
        == [f"{block}.{layer}.weight" for block in range(3) for layer in ("in_proj", "out_proj")]
    )
    for name, param in model.named_parameters():
        wrapped = isinstance(param, Float8GatherWeightMeshOnly)
        assert wrapped == (name in names) and isinstance(param, nn.Parameter), name
        value = param._tensor if wrapped else param.detach()
        assert torch.equal(value, before[name]), name
    with pytest.raises(ValueError, match="already has"):
        to_float8_gather(model)
    with pytest.raises(ValueError, match="1 or 5"):
        to_float8_gather(MLPStack(5), hook_arguments=2)


def test_the_reference_computes_with_the_quantized_weights_and_checks_names():
    model = init_deterministic(MLPStack(5))
    names = float8_weight_names(model)
    reference = Float8GatherReference(copy.deepcopy(model), names)
    quantized = copy.deepcopy(model)
    with torch.no_grad():
        for name in names:
            quantized.get_parameter(name).copy_(quantize_dequantize(model.get_parameter(name)))
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reference(x), quantized(x))
    assert not torch.equal(reference(x), model(x))
    reference(x).sum().backward()
    quantized(x).sum().backward()
    for (name, ref_param), param in zip(
        reference.module.named_parameters(), quantized.parameters()
    ):
        assert torch.equal(ref_param.grad, param.grad), name  # straight through
    with pytest.raises(ValueError, match="no parameter"):
        Float8GatherReference(model, ["nope.weight"])
