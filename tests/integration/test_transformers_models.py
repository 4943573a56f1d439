"""A real client: Hugging Face models checked the way a downstream project checks them.

GPT-2 (its head shares the token embedding's weight) and a small Llama, built from a config
(nothing is downloaded), sharded per decoder block: through ``parity_scenarios`` under
reffsdp's ``fully_shard`` and its ``FullyShardedDataParallel`` with an auto-wrap policy,
every feature and both state-dict kinds, at the default tolerances; under torch's own
``fully_shard`` through ``check_train_parity``, whose losses reffsdp's match; and through
the pytest plugin's ``thread_world`` fixture, as a project's own test would.
"""

from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach a hub

import pytest  # noqa: E402

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from reffsdp import fully_shard  # noqa: E402
from reffsdp.testing import (  # noqa: E402
    build_seeded,
    check_train_parity,
    expected_counts,
    parity_scenarios,
)
from reffsdp.testing.common import device_type_under_test  # noqa: E402

pytest_plugins = ["reffsdp.testing.pytest_plugin"]
pytestmark = pytest.mark.multithread

VOCAB = 128
ALL_FEATURES = ["fp32", "reshard", "accum", "offload", "sd-full", "sd-sharded", "bf16"]
ALL_FEATURES += ["orig-params"]
# Every feature under each API and each API on both meshes, for each model: half the
# matrix, so the folder stays fast on two cores (the parity suite runs the whole matrix on
# its own models).
PLAN = {
    ("fully_shard", "1d"): ("fp32", "bf16", "offload", "sd-full"),
    ("fully_shard", "hsdp"): ("reshard", "accum", "sd-sharded"),
    ("wrapper", "1d"): ("orig-params", "reshard", "sd-sharded"),
    ("wrapper", "hsdp"): ("fp32", "bf16", "accum", "offload", "sd-full"),
}


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # the same numbers on both sides
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def make_inputs(iteration: int, rank: int) -> dict[str, torch.Tensor]:
    """A padded batch: token ids, an attention mask and labels that skip the padding."""
    generator = torch.Generator().manual_seed(1000 * iteration + rank)
    input_ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def model_loss(output) -> torch.Tensor:
    return output.loss


def logits_loss(output) -> torch.Tensor:
    return output.logits.float().square().mean()


MODELS = {
    "gpt2": (gpt2, GPT2Block, model_loss),
    "llama": (llama, LlamaDecoderLayer, logits_loss),
}


def _scenarios():
    params = []
    for model_name, (factory, block, loss_fn) in MODELS.items():
        scenarios = parity_scenarios(
            factory,
            make_inputs,
            block_types=[block],
            features=ALL_FEATURES,
            loss_fn=loss_fn,
            steps=2,
            name=model_name,
        )
        for scenario in scenarios:
            spec = scenario.spec
            if spec.feature not in PLAN[spec.api, spec.mesh]:
                continue
            params.append(pytest.param(scenario, id=scenario.name))
    return params


@pytest.mark.parametrize("scenario", _scenarios())
def test_every_feature_passes_at_the_default_tolerances(scenario):
    """Each scenario checks losses, gradients, parameters, collective counts and bytes (on
    the GPU with ``--device cuda``)."""
    result = scenario.run_threaded(device_type_under_test())
    assert result.status == "passed", result.message
    assert result.counts == result.expected_counts


@pytest.mark.parametrize("model_name", MODELS)
def test_torch_fully_shard_and_reffsdp_agree_on_hsdp(thread_world, model_name):
    """torch's fully_shard passes the same check at the default tolerance (HSDP sums in
    another order than DDP), and reffsdp's losses are torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    factory, block_type, loss_fn = MODELS[model_name]

    def on_rank(rank: int) -> dict[str, list[float]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        losses = {}
        for name, shard in (("torch", torch_fully_shard), ("reffsdp", fully_shard)):
            model = build_seeded(factory, seed=0)
            ref_model = copy.deepcopy(model)
            for block in [m for m in model.modules() if isinstance(m, block_type)]:
                shard(block, mesh=mesh)
            shard(model, mesh=mesh)
            losses[name] = check_train_parity(
                None, ref_model, model, make_inputs, num_steps=3, loss_fn=loss_fn
            )
        return losses

    for losses in thread_world(on_rank, world_size=4):
        torch.testing.assert_close(losses["reffsdp"], losses["torch"], rtol=1e-6, atol=1e-6)


def test_a_project_test_with_the_plugin(thread_world):
    """What a project's own test looks like: shard GPT-2 per block, check training against
    DDP, and assert reffsdp's collectives per step."""

    def on_rank(rank: int) -> list[float]:
        model = build_seeded(gpt2, seed=0)  # the same weights on every rank
        counts = expected_counts(model, [GPT2Block])  # before sharding
        ref_model = copy.deepcopy(model)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return check_train_parity(
            None,
            ref_model,
            model,
            make_inputs,
            loss_fn=lambda out: out.loss,
            block_types=[GPT2Block],
            expected_counts=counts,
        )

    losses = thread_world(on_rank, world_size=2)
    assert losses[0] != losses[1]  # each rank trains on its own batch
