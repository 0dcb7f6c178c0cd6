"""diffusers transformers split by their own context-parallel plans (`_cp_plan`) on real gloo ranks, attention by our
methods: each equals the same transformer in one process (float32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel, QwenImageTransformer2DModel

from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.context_parallel import check_plan, split_by_plan
from tests.distributed import run_ranks

IMAGE_SIDE = 4  # latent patches per side: 16 image tokens
TEXT_TOKENS = 6

MODELS = {
    "qwen-image": (QwenImageTransformer2DModel, dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                      attention_head_dim=16, num_attention_heads=4,
                                                      joint_attention_dim=24, axes_dims_rope=(4, 6, 6))),
    "flux2": (Flux2Transformer2DModel, dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=24,
                                            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))),
    "flux": (FluxTransformer2DModel, dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=4, joint_attention_dim=24,
                                          pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(4, 6, 6))),
}


def transformer(name: str) -> torch.nn.Module:
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    return model_class(**config).eval()


def request(name: str, text_tokens: int = TEXT_TOKENS, text_mask: bool = False, side: int = IMAGE_SIDE) -> dict:
    """A seeded call of the model as its pipeline makes it for an image of side x side patches, batch 1 (batch 2 with
    text_mask: the second sample's text two tokens shorter, padding masked)."""
    generator = torch.Generator().manual_seed(1)
    batch = 2 if text_mask else 1
    tokens = side * side
    hidden = torch.randn(batch, tokens, 16, generator=generator)
    text = torch.randn(batch, text_tokens, 24, generator=generator)
    timestep = torch.full((batch,), 0.7)
    if name == "qwen-image":
        call = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep,
                    img_shapes=[[(1, side, side)]] * batch)
        if text_mask:
            mask = torch.ones(batch, text_tokens, dtype=torch.bool)
            mask[1, -2:] = False
            call["encoder_hidden_states_mask"] = mask
        return call
    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    if name == "flux2":
        img_ids = torch.stack([torch.zeros(tokens), torch.zeros(tokens), rows.flatten(), columns.flatten()], -1)
        txt_ids = torch.stack([torch.zeros(text_tokens)] * 3 + [torch.arange(text_tokens).float()], -1)
        return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep, guidance=torch.full((1,), 4.0),
                    img_ids=img_ids[None].float(), txt_ids=txt_ids[None])
    img_ids = torch.stack([torch.zeros(tokens), rows.flatten(), columns.flatten()], -1).float()
    return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep, guidance=torch.full((1,), 3.5),
                pooled_projections=torch.randn(1, 8, generator=generator), img_ids=img_ids,
                txt_ids=torch.zeros(text_tokens, 3))


def split_forward(comm: Communicator, name: str, call: dict) -> tuple[torch.Tensor, int]:
    """The split model's output, and the tokens its last layer (proj_out) ran on this rank."""
    model = transformer(name)
    split_by_plan(model, comm)
    local = []
    model.proj_out.register_forward_pre_hook(lambda module, args: local.append(args[0].shape[1]))
    with torch.no_grad():
        return model(**call, return_dict=False)[0], local[0]


def on_ranks(rank: int, world_size: int, cases: list[tuple[str, ParallelPlan, dict]]) -> list:
    """Each case (model, plan, call) on this rank: its output and local image tokens, or the message of the
    RequestError it raised."""
    results = []
    for name, plan, call in cases:
        comm = Communicator(plan, rank, torch.device("cpu"))
        comm.join_groups()
        try:
            results.append(split_forward(comm, name, call))
        except RequestError as error:
            results.append(str(error))
    return results


def one_process(name: str, call: dict) -> torch.Tensor:
    with torch.no_grad():
        return transformer(name)(**call, return_dict=False)[0]


PLANS = [ParallelPlan(cp_size=2, cp_method=method) for method in ("allgather_kv", "ring", "ulysses")]
# Every model on every method; a batch whose text padding is masked; sequences that do not split evenly (a text of 5
# tokens, an image of 3 x 3 patches, both with the masked batch); a text shorter than the ranks: one start of the ranks
# for all.
CASES = ([(name, plan, request(name)) for name in sorted(MODELS) for plan in PLANS]
         + [("qwen-image", plan, request("qwen-image", text_mask=True)) for plan in PLANS]
         + [("flux2", plan, request("flux2", text_tokens=5)) for plan in PLANS]
         + [("qwen-image", plan, request("qwen-image", text_tokens=5, side=3)) for plan in PLANS]
         + [("qwen-image", PLANS[2], request("qwen-image", text_tokens=7, text_mask=True, side=3))]
         + [("flux2", PLANS[1], request("flux2", text_tokens=1))])


def image_tokens(call: dict) -> int:
    return call["hidden_states"].shape[1]


def case_id(name: str, plan: ParallelPlan, call: dict) -> str:
    masked = "-masked" if "encoder_hidden_states_mask" in call else ""
    return f"{name}-{plan.cp_method}-{call['encoder_hidden_states'].shape[1]}+{image_tokens(call)}{masked}"


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """Each case's outputs on 2 gloo ranks, by its index in CASES."""
    return dict(enumerate(zip(*run_ranks(2, on_ranks, CASES))))


@pytest.mark.parametrize("index", range(len(CASES) - 1),
                         ids=[case_id(*case) for case in CASES[:-1]])
def test_each_method_equals_one_process(two_ranks, index):
    name, plan, call = CASES[index]
    expected = one_process(name, call)
    shares = []
    for result in two_ranks[index]:
        assert isinstance(result, tuple), result
        output, local_tokens = result
        shares.append(local_tokens)
        torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)
    tokens = image_tokens(call)
    assert shares == [(tokens + 1) // 2, tokens // 2]  # each rank ran its share of the image


def test_a_sequence_shorter_than_the_ranks_is_refused_naming_it(two_ranks):
    for message in two_ranks[len(CASES) - 1]:
        assert "encoder_hidden_states has 1 tokens" in message and "fewer than the 2" in message, message


def test_ulysses_ring_on_four_ranks_equals_one_process():
    call = request("qwen-image", text_tokens=8)
    plan = ParallelPlan(cp_size=4, cp_method="ulysses_ring", ulysses_size=2)
    for (output, local_tokens), in run_ranks(4, on_ranks, [("qwen-image", plan, call)]):
        assert local_tokens == IMAGE_SIDE * IMAGE_SIDE // 4
        torch.testing.assert_close(output, one_process("qwen-image", call), rtol=1e-4, atol=1e-5)


def test_plans_that_cannot_split_a_transformer_are_refused_at_build():
    config = MODELS["qwen-image"][1]
    with pytest.raises(EngineError, match="3 attention heads"):
        check_plan(QwenImageTransformer2DModel, {**config, "num_attention_heads": 3}, PLANS[2])
    with pytest.raises(EngineError, match="--tp 1"):
        check_plan(QwenImageTransformer2DModel, config, ParallelPlan(tp_size=2))
    with pytest.raises(EngineError, match="declares no context-parallel plan"):
        check_plan(torch.nn.Linear, {}, PLANS[0])


def compiled_on_ranks(rank: int, world_size: int, calls: list[dict]) -> tuple[list[torch.Tensor], int, bool]:
    """Qwen-Image split by Ulysses with its blocks compiled as a GPU rank serves it (QwenImagePipelinePart.prepare):
    its output for each call, the graphs Dynamo made, and whether its blocks are compiled."""
    from torch._dynamo.utils import counters

    from mdtriton.families.qwen_image import QWEN_IMAGE

    comm = Communicator(ParallelPlan(cp_size=2, cp_method="ulysses"), rank, torch.device("cpu"))
    comm.join_groups()
    model = transformer("qwen-image")
    QWEN_IMAGE.prepare(SimpleNamespace(transformer=model), comm, compiled=True)
    with torch.no_grad():
        outputs = [model(**call, return_dict=False)[0] for call in calls]
    compiled = all(block._compiled_call_impl is not None for block in model.transformer_blocks)
    return outputs, counters["stats"]["unique_graphs"], compiled


def test_compiled_blocks_split_by_the_plan_equal_one_process():
    """What a GPU rank runs (the repeated blocks compiled with symbolic sizes, the split's hooks and our attention
    eager between them), on 2 gloo ranks: an even split and an uneven one (padded, masked) equal the eager model."""
    calls = [request("qwen-image"), request("qwen-image", text_tokens=5, side=3)]
    for outputs, graphs, compiled in run_ranks(2, compiled_on_ranks, calls):
        assert compiled and graphs > 0
        for output, call in zip(outputs, calls):
            torch.testing.assert_close(output, one_process("qwen-image", call), rtol=1e-4, atol=1e-5)
