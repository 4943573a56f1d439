"""The standard test models: shapes, names, tying, checkpointing and determinism."""

import pytest
import torch
import torch.nn as nn

from reffsdp.testing.models import (
    MLP,
    ConvNet,
    DoubleLinear,
    MLPStack,
    ModelArgs,
    Transformer,
    TransformerBlock,
)


def _param_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in module.named_parameters()}


def test_mlp_shapes_and_options():
    assert _param_shapes(MLP(5)) == {
        "in_proj.weight": (20, 5),
        "in_proj.bias": (20,),
        "out_proj.weight": (5, 20),
        "out_proj.bias": (5,),
    }
    assert _param_shapes(MLP(5, bias=False, dim_multiplier=3)) == {
        "in_proj.weight": (15, 5),
        "out_proj.weight": (5, 15),
    }
    assert MLP(5).buffer is None
    assert MLP(5)(torch.randn(2, 5)).shape == (2, 5)


def test_mlp_buffer_is_added_and_reset():
    torch.manual_seed(0)
    mlp = MLP(4, with_buffer=True)
    assert [name for name, _ in mlp.named_buffers()] == ["buffer"]
    x = torch.randn(3, 4)
    without_buffer = torch.relu(mlp.out_proj(torch.relu(mlp.in_proj(x))))
    torch.testing.assert_close(mlp(x), without_buffer + mlp.buffer)
    before = mlp.buffer.clone()
    mlp.reset_parameters()
    assert not torch.equal(before, mlp.buffer)


def test_mlp_on_meta_device():
    mlp = MLP(4, device="meta", with_buffer=True)
    assert all(t.is_meta for t in [*mlp.parameters(), *mlp.buffers()])


@pytest.mark.parametrize("with_seq_parallel", [False, True])
def test_mlp_stack(with_seq_parallel):
    stack = MLPStack(6, with_seq_parallel=with_seq_parallel)
    hidden = [block.in_proj.out_features for block in stack[:3]]
    assert hidden == [18, 24, 18]
    assert len(stack) == (4 if with_seq_parallel else 3)
    if with_seq_parallel:
        assert isinstance(stack[3], nn.LayerNorm)
        assert stack[3].bias is None
    assert stack(torch.randn(2, 6)).shape == (2, 6)


def test_double_linear_outputs_and_unused_layer():
    both = DoubleLinear(3)
    out1, out2 = both(torch.randn(2, 3))
    assert out1.shape == out2.shape == (2, 3)

    one = DoubleLinear(3, use_second_linear=False)
    out = one(torch.randn(2, 3))
    assert isinstance(out, torch.Tensor)
    out.sum().backward()
    assert one.lin1.weight.grad is not None
    assert one.lin2.weight.grad is None


def test_transformer_module_names_and_output():
    args = ModelArgs()
    model = Transformer(args)
    children = [name for name, _ in model.named_children()]
    assert children == ["tok_embeddings", "pos_embeddings", "dropout", "layers", "norm", "output"]
    block_children = [name for name, _ in model.layers[0].named_children()]
    assert block_children == ["attention_norm", "attention", "ffn_norm", "feed_forward"]
    assert {"wq", "wk", "wv", "wo"} <= {
        name for name, _ in model.layers[0].attention.named_children()
    }
    tokens = torch.randint(0, args.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, args.vocab_size)
    assert logits.dtype == torch.float32
    assert model.to(torch.bfloat16)(tokens).dtype == torch.float32


def test_transformer_defaults_are_parity_friendly():
    args = ModelArgs()
    assert (args.dropout_p, args.weight_tying, args.checkpoint_activations) == (0.0, False, False)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    torch.testing.assert_close(model.train()(tokens), model.eval()(tokens))


def test_transformer_weight_tying():
    untied = Transformer(ModelArgs())
    tied = Transformer(ModelArgs(weight_tying=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    names = [name for name, _ in tied.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    assert len(list(untied.parameters())) == len(list(tied.parameters())) + 1


def test_transformer_checkpointing_recomputes_blocks_with_same_grads(monkeypatch):
    torch.manual_seed(0)
    plain = Transformer(ModelArgs())
    checkpointed = Transformer(ModelArgs(checkpoint_activations=True))
    checkpointed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 8, (2, 8))
    # Module hooks do not fire during recomputation, so count calls to forward itself.
    block_forwards = []
    original_forward = TransformerBlock.forward

    def counting_forward(self, x):
        block_forwards.append(self)
        return original_forward(self, x)

    monkeypatch.setattr(TransformerBlock, "forward", counting_forward)
    plain(tokens).sum().backward()
    assert len(block_forwards) == 2
    block_forwards.clear()
    checkpointed(tokens).sum().backward()
    assert len(block_forwards) == 4  # each block runs again during backward
    for (name, p1), (_, p2) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, msg=name)


def test_transformer_is_deterministic_given_the_seed():
    def build_and_run():
        torch.manual_seed(1)
        model = Transformer(ModelArgs())
        return model, model(torch.randint(0, 8, (2, 8)))

    (first, out1), (second, out2) = build_and_run(), build_and_run()
    for p1, p2 in zip(first.parameters(), second.parameters()):
        assert torch.equal(p1, p2)
    assert torch.equal(out1, out2)


def test_transformer_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelArgs(dim=10, n_heads=4)
    model = Transformer(ModelArgs(max_seq_len=4))
    with pytest.raises(ValueError, match="exceeds max_seq_len 4"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("image_size", [1, 4, 7])
def test_convnet_on_tiny_images(image_size):
    model = ConvNet(in_channels=3, num_classes=5)
    assert model(torch.randn(2, 3, image_size, image_size)).shape == (2, 5)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model.conv1.weight.dim() == 4
