"""The Wan transformer engine against diffusers' WanTransformer3DModel (float32, the same weights): on one rank and
on every plan of 2, 3 and 4 real gloo ranks, with token counts that do not divide by the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.cli import main
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.wan import WAN
from mdtriton.families.wan.transformer import TINY_CONFIG
from tests.conftest import start_server
from tests.distributed import run_ranks
from tests.engine.flux_cases import max_relative_error, run_engines, write_engine

# Latent sizes (frames, height, width): 3 x 3 x 5 = 45 tokens divide by 3 but not by 2 or 4; 2 x 1 x 2 = 4 tokens
# leave a rank of 3 with one real token and padding; a cross_attn_norm-free variant is checked on one rank.
LATENTS = [(3, 6, 10), (2, 2, 4)]
CP_METHODS = ("allgather_kv", "ring", "ulysses")
PLANS = {
    2: [ParallelPlan(cp_size=2, cp_method=m) for m in CP_METHODS] + [ParallelPlan(tp_size=2)],
    3: [ParallelPlan(cp_size=3, cp_method=m) for m in CP_METHODS] + [ParallelPlan(tp_size=3)],
    4: [ParallelPlan(cp_size=4, cp_method=m) for m in ("allgather_kv", "ring")]
       + [ParallelPlan(tp_size=2, cp_size=2, cp_method=m) for m in ("allgather_kv", "ring")]
       + [ParallelPlan(cp_size=4, cp_method="ulysses_ring", ulysses_size=2)],
}


def diffusers_model(config: dict, seed: int) -> WanTransformer3DModel:
    """diffusers' model with random weights, its norms and modulation tables moved off their initial values (so a
    norm weight applied on the wrong columns shows)."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**config, "patch_size": tuple(config["patch_size"])}).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "scale_shift_table" in name or name.endswith("bias"):
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model


def wan_inputs(config: dict, latent: tuple[int, int, int], seed: int, batch: int = 2,
               text_len: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(batch, config["in_channels"], *latent, generator=generator),
            "timestep": 1000 * torch.rand(batch, generator=generator),
            "encoder_hidden_states": torch.randn(batch, text_len, config["text_dim"], generator=generator)}


def expected_samples(model: WanTransformer3DModel, cases: list[dict]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(**inputs, return_dict=False)[0] for inputs in cases]


def test_weight_names_and_shapes_are_diffusers():
    reference = WanTransformer3DModel(**{**TINY_CONFIG, "patch_size": tuple(TINY_CONFIG["patch_size"])})
    ours = meta_module(WAN, TINY_CONFIG, ParallelPlan(), 0).state_dict()
    assert {name: tuple(t.shape) for name, t in ours.items()} == {
        name: tuple(t.shape) for name, t in reference.state_dict().items()}


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_one_rank_equals_diffusers(tmp_path, cross_attn_norm):
    config = {**TINY_CONFIG, "cross_attn_norm": cross_attn_norm}
    model = diffusers_model(config, seed=1)
    cases = [wan_inputs(config, latent, seed=i) for i, latent in enumerate(LATENTS)]
    engine_dir = write_engine(tmp_path / "engine", config, ParallelPlan(), model.state_dict(), "wan")
    engine = TorchEngine.load(engine_dir, Manifest.read(engine_dir), WAN, Communicator.single())
    for inputs, want in zip(cases, expected_samples(model, cases)):
        got = engine.forward(inputs)["sample"]
        assert got.shape == want.shape
        assert max_relative_error(got, want) < 1e-5


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_plan_equals_diffusers(tmp_path, world_size):
    model = diffusers_model(TINY_CONFIG, seed=2)
    cases = [wan_inputs(TINY_CONFIG, latent, seed=i) for i, latent in enumerate(LATENTS)]
    expected = expected_samples(model, cases)
    engine_dirs = {}
    for plan in PLANS[world_size]:
        name = f"tp{plan.tp_size}_cp{plan.cp_size}" + (f"_{plan.cp_method}" if plan.cp_size > 1 else "")
        engine_dirs[name] = str(write_engine(tmp_path / name, TINY_CONFIG, plan, model.state_dict(), "wan"))
    for rank, results in enumerate(run_ranks(world_size, run_engines, engine_dirs, cases)):
        for name, samples in results.items():
            for latent, sample, want in zip(LATENTS, samples, expected):
                error = max_relative_error(torch.from_numpy(sample), want)
                assert error < 1e-4, f"{name}, rank {rank}, latent {latent}: error {error:.2e}"


# Image to video: Wan 2.1 I2V's image tokens beside the text (36 input channels here 9: a config value), and Wan 2.2
# TI2V given an image, whose first latent frame's tokens have timestep 0. diffusers' I2V transformer takes the text as
# its last 512 tokens.
I2V_CONFIG = {**TINY_CONFIG, "in_channels": 9, "image_dim": 8, "added_kv_proj_dim": 72}
I2V_PLANS = [ParallelPlan(cp_size=2, cp_method=m) for m in ("ulysses", "ring")] + [ParallelPlan(tp_size=2)]


def image_cases() -> list[tuple[dict, dict]]:
    """(config, inputs) for an image-to-video transformer with image tokens, and for a timestep per token."""
    with_image = wan_inputs(I2V_CONFIG, (3, 6, 10), seed=5, text_len=512)
    with_image["encoder_hidden_states_image"] = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    per_token = wan_inputs(TINY_CONFIG, (3, 6, 10), seed=7)
    timestep = per_token["timestep"][:, None].repeat(1, 45)
    timestep[:, :15] = 0  # the first latent frame: 3 x 5 patches
    return [(I2V_CONFIG, with_image), (TINY_CONFIG, {**per_token, "timestep": timestep})]


def test_image_to_video_on_one_and_two_ranks_equals_diffusers(tmp_path):
    for i, (config, inputs) in enumerate(image_cases()):
        model = diffusers_model(config, seed=8 + i)
        (want,) = expected_samples(model, [inputs])
        engine_dirs = {}
        for plan in [ParallelPlan()] + I2V_PLANS:
            name = f"case{i}_tp{plan.tp_size}_cp{plan.cp_size}_{plan.cp_method}"
            engine_dirs[name] = str(write_engine(tmp_path / name, config, plan, model.state_dict(), "wan"))
        one = engine_dirs.pop(f"case{i}_tp1_cp1_{ParallelPlan().cp_method}")
        engine = TorchEngine.load(Path(one), Manifest.read(Path(one)), WAN, Communicator.single())
        assert max_relative_error(engine.forward(inputs)["sample"], want) < 1e-5
        with torch.inference_mode():  # First Block Cache's parts carry the image's tokens and the per-token modulation
            parts = engine.module.other_blocks(**inputs, **engine.module.first_block(**inputs))
        assert max_relative_error(parts["sample"], want) < 1e-5
        for rank, results in enumerate(run_ranks(2, run_engines, engine_dirs, [inputs])):
            for name, (sample,) in results.items():
                error = max_relative_error(torch.from_numpy(sample), want)
                assert error < 1e-4, f"{name}, rank {rank}: error {error:.2e}"


@pytest.mark.parametrize("preset", sorted(WAN.presets()))
def test_every_preset_builds_and_has_its_parameter_count(preset):
    counts = {"tiny": 0.000143, "wan2.1-t2v-1.3b": 1.42, "wan2.1-t2v-14b": 14.29, "wan2.2-ti2v-5b": 5.0,
              "wan2.1-i2v-14b": 16.4}
    module = meta_module(WAN, WAN.presets()[preset], ParallelPlan(), 0)
    assert sum(t.numel() for t in module.state_dict().values()) / 1e9 == pytest.approx(counts[preset], rel=0.02)


def test_requests_that_do_not_fit_say_what_to_send():
    inputs = wan_inputs(TINY_CONFIG, (3, 5, 10), seed=0)
    with pytest.raises(ValueError, match="5 latent height, not a multiple of the patch size 2"):
        WAN.request_size(TINY_CONFIG, inputs)
    inputs = wan_inputs(TINY_CONFIG, (3, 6, 10), seed=0)
    assert WAN.request_size(TINY_CONFIG, inputs).tokens == 45
    inputs["timestep"] = inputs["timestep"][:1]
    with pytest.raises(ValueError, match="timestep has batch size 1 but hidden_states has 2"):
        WAN.request_size(TINY_CONFIG, inputs)


def test_ulysses_with_indivisible_heads_says_what_to_use():
    with pytest.raises(ValueError, match="use cp_method allgather_kv or ring"):
        WAN.check_plan(TINY_CONFIG, ParallelPlan(cp_size=4, cp_method="ulysses"))
    with pytest.raises(ValueError, match="image_dim 1280 and added_kv_proj_dim None"):
        WAN.check_plan({**TINY_CONFIG, "image_dim": 1280}, ParallelPlan())


@pytest.mark.timeout(300)
def test_the_transformer_engine_served_on_two_ranks_answers_as_one_process(tmp_path):
    """`mdtriton build --architecture wan` (cp 2, ring), served by Triton: its warm-up request (the family's sample)
    passes the request check, and a request with padding on the second rank equals the one-rank module."""
    assert main(["build", str(tmp_path / "repository"), "--name", "wan", "--architecture", "wan", "--cp", "2",
                 "--cp-method", "ring", "--seed", "7"]) == 0
    inputs = wan_inputs(TINY_CONFIG, (3, 6, 10), seed=3)
    module = reference_module("wan", TINY_CONFIG, random_weights("wan", TINY_CONFIG, 7), "FP32")
    with torch.inference_mode():
        expected = module(**inputs)["sample"]
    server = start_server(tmp_path / "repository", tmp_path / "server.log")
    try:
        with Client(server.grpc_address) as client:
            sample = client.infer("wan", inputs)["sample"]
            with pytest.raises(ClientError, match="5 latent height, not a multiple of the patch size 2"):
                client.infer("wan", wan_inputs(TINY_CONFIG, (3, 5, 10), seed=3))
    finally:
        server.stop()
    assert max_relative_error(torch.tensor(sample), expected) < 1e-4
