"""The Cosmos 3 transformer engine against diffusers' Cosmos3OmniTransformer (float32, the same weights): on one rank
(both backbones) and on every plan of 2 and 4 real gloo ranks, with token counts that do not divide by the ranks and
ranks that hold only text; its text pathway run once and handed to the step (as the pipeline runs it) and First Block
Cache's parts give the same velocity; FP8 weights and compiled regions on CPU; served by Triton."""

from __future__ import annotations

import pytest
import torch
from diffusers import Cosmos3OmniTransformer
from torch._dynamo.utils import counters

from mdtriton.build_tools.engine_builder import random_shard, random_weights, reference_module
from mdtriton.cli import main
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.modules import meta_module
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.step_cache import FirstBlockCache, StepCache
from mdtriton.families.cosmos3 import COSMOS3
from mdtriton.families.cosmos3.transformer import TINY_CONFIG
from mdtriton.harness import relative_error
from tests.conftest import start_server
from tests.distributed import run_ranks
from tests.engine.plans import PLANS
from mdtriton.testing.cosmos3_cases import (NEMOTRON, Case, diffusers_inputs, diffusers_model, engine_inputs,
                                        expected_sample, module_weights)
from tests.engine.flux_cases import max_relative_error, rank_engine, write_engine

# 7 text + 18 video tokens (odd latent width, a conditioning frame) divide by neither 2 nor 4; 20 text + 3 video
# tokens (an image) leave ranks of 4 with text only; 5 + 12 at 12 fps.
CASES = [Case(7, 3, 4, 5, conditioning=1, fps=30.0), Case(20, 1, 2, 6), Case(5, 2, 6, 4, fps=12.0)]
# Of the plans (tests/engine/plans.py): tp 4 keeps one key/value head for two ranks; ulysses on 4 ranks (and on 2 with
# tp 2) copies key/value heads.


def three_ways(rank: int, world_size: int, engine_dirs: dict[str, str], cases: list[dict]) -> dict[str, list]:
    """On one rank: each engine's velocity for every case, as a transformer engine runs it (the text's ids in) and as
    the pipeline runs it (the text's keys and values made once, then handed in); for the first case also through First
    Block Cache's parts (a full step, then the same step again, which skips every layer after the first) and how many
    of the two steps ran every layer."""
    results = {}
    for name, engine_dir in engine_dirs.items():
        engine = rank_engine(rank, engine_dir)
        samples = []
        for inputs in cases:
            with torch.inference_mode():
                text = engine.module.text_keys_values(inputs["input_ids"], inputs["position_ids"])
            handed = {**{k: v for k, v in inputs.items() if k != "input_ids"}, "text_keys_values": text}
            samples.append([engine.forward(inputs)["sample"].numpy(), engine.forward(handed)["sample"].numpy()])
        cache = StepCache(FirstBlockCache(threshold=0.0))
        samples[0] += [engine.forward(cases[0], cache)["sample"].numpy() for _ in range(2)]
        results[name] = (samples, cache.full_steps)
    return results


def test_weight_names_and_shapes_are_diffusers_but_the_unused_heads():
    with torch.device("meta"):
        reference = Cosmos3OmniTransformer(**TINY_CONFIG).state_dict()
    ours = meta_module(COSMOS3, TINY_CONFIG, ParallelPlan(), 0).state_dict()
    assert {name: tuple(t.shape) for name, t in ours.items()} == {
        name: tuple(t.shape) for name, t in reference.items() if not name.startswith(COSMOS3.unused_weights)}
    assert sorted({name.split(".")[0] for name in reference if name.startswith(COSMOS3.unused_weights)}) == [
        "lm_head", "norm"]


@pytest.mark.parametrize("backbone", ["qwen3", "nemotron"])
def test_one_rank_equals_diffusers(tmp_path, backbone):
    config = {**TINY_CONFIG, **(NEMOTRON if backbone == "nemotron" else {})}
    model = diffusers_model(config, seed=1)
    engine_dir = write_engine(tmp_path / "engine", config, ParallelPlan(), module_weights(model), "cosmos3")
    engine = TorchEngine.load(engine_dir, Manifest.read(engine_dir), COSMOS3, Communicator.single())
    for seed, case in enumerate(CASES):
        call = diffusers_inputs(config, case, seed)
        want = expected_sample(model, call)
        got = engine.forward(engine_inputs(call))["sample"]
        assert got.shape == want.shape == (1, 4, case.frames, case.height, case.width)
        assert max_relative_error(got, want) < 1e-5, case
        assert not got[:, :, :case.conditioning].any()  # conditioning frames: zeros, as diffusers leaves them


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_plan_equals_diffusers_with_the_text_once_and_first_block_cache(tmp_path, world_size):
    model = diffusers_model(TINY_CONFIG, seed=2)
    cases = CASES[:2]
    calls = [diffusers_inputs(TINY_CONFIG, case, seed) for seed, case in enumerate(cases)]
    expected = [expected_sample(model, call) for call in calls]
    engine_dirs = {}
    for plan in PLANS[world_size]:
        name = f"tp{plan.tp_size}_cp{plan.cp_size}" + (f"_{plan.cp_method}" if plan.cp_size > 1 else "")
        engine_dirs[name] = str(write_engine(tmp_path / name, TINY_CONFIG, plan, module_weights(model), "cosmos3"))
    per_rank = run_ranks(world_size, three_ways, engine_dirs, [engine_inputs(call) for call in calls])
    ways = ("ids", "text once", "first block, full", "first block, skipping")
    for rank, results in enumerate(per_rank):
        for name, (samples, full_steps) in results.items():
            for case, case_samples, want in zip(cases, samples, expected):
                for way, sample in zip(ways, case_samples):
                    error = max_relative_error(torch.from_numpy(sample), want)
                    assert error < 1e-4, f"{name}, rank {rank}, {case}, {way}: error {error:.2e}"
            assert full_steps == 1, f"{name}, rank {rank}: the repeated step ran every layer"


@pytest.mark.parametrize("preset", sorted(COSMOS3.presets()))
def test_every_preset_builds_and_has_diffusers_parameter_count(preset):
    config = COSMOS3.presets()[preset]
    with torch.device("meta"):
        reference = sum(t.numel() for t in Cosmos3OmniTransformer(**config).parameters())
    module = meta_module(COSMOS3, config, ParallelPlan(), 0)
    unused = config["vocab_size"] * config["hidden_size"] + config["hidden_size"]  # lm_head and the text's norm
    assert sum(t.numel() for t in module.state_dict().values()) == reference - unused
    if preset == "cosmos3-15b":
        assert reference / 1e9 == pytest.approx(15.2, abs=0.05)
        shard = meta_module(COSMOS3, config, ParallelPlan(tp_size=8), 3).state_dict()
        assert shard["layers.0.self_attn.add_k_proj.weight"].shape == (128, 4096)  # one of the 8 key/value heads


def test_plans_that_cannot_split_it_say_what_to_choose():
    with pytest.raises(ValueError, match="num_attention_heads 4 does not divide by tp_size 3"):
        COSMOS3.check_plan(TINY_CONFIG, ParallelPlan(tp_size=3))
    with pytest.raises(ValueError, match="use cp_method allgather_kv or ring"):
        COSMOS3.check_plan(TINY_CONFIG, ParallelPlan(cp_size=3, cp_method="ulysses"))
    grouped = {**TINY_CONFIG, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96}
    with pytest.raises(ValueError, match="key/value heads of two groups of 3; choose a tp_size that divides the 4"):
        COSMOS3.check_plan(grouped, ParallelPlan(tp_size=6))
    # Cosmos 3's 8 key/value heads on 16 ranks: ulysses copies them; tensor parallelism keeps one for two ranks.
    published = COSMOS3.presets()["cosmos3-15b"]
    COSMOS3.check_plan(published, ParallelPlan(cp_size=16, cp_method="ulysses"))
    COSMOS3.check_plan(published, ParallelPlan(tp_size=16))


def test_requests_that_do_not_fit_say_what_to_send():
    inputs = engine_inputs(diffusers_inputs(TINY_CONFIG, CASES[0], seed=0))
    assert COSMOS3.request_size(TINY_CONFIG, inputs).tokens == 7 + 18
    with pytest.raises(ValueError, match="noisy_frames has 2 values for 3 latent frames"):
        COSMOS3.request_size(TINY_CONFIG, {**inputs, "noisy_frames": inputs["noisy_frames"][:2]})
    with pytest.raises(ValueError, match="position_ids has 24 positions for 7 text and 18 video tokens"):
        COSMOS3.request_size(TINY_CONFIG, {**inputs, "position_ids": inputs["position_ids"][:, :24]})
    with pytest.raises(ValueError, match="send ids from 0 to 263"):
        COSMOS3.request_size(TINY_CONFIG, {**inputs, "input_ids": inputs["input_ids"] + 264})


def test_fp8_weights_give_the_velocity_within_e4m3_rounding():
    """FP8 engines run on GPUs; torch 2.13's CPU backend runs the same row-scaled FP8 GEMMs, so the module with this
    rank's quantized shard is checked here against float32 weights."""
    weights = random_weights("cosmos3", TINY_CONFIG, seed=3)
    shard = random_shard("cosmos3", TINY_CONFIG, ParallelPlan(), 0, seed=3, quantization="fp8")
    assert shard["layers.0.self_attn.add_q_proj.weight"].dtype == torch.float8_e4m3fn
    assert shard["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn  # the text pathway's too
    assert shard["time_embedder.linear_1.weight"].dtype == torch.float32
    inputs = engine_inputs(diffusers_inputs(TINY_CONFIG, CASES[2], seed=3))
    with torch.inference_mode():
        want = reference_module("cosmos3", TINY_CONFIG, weights, "FP32")(**inputs)["sample"]
        fp8 = TorchEngine.from_weights(Manifest("cosmos3", TINY_CONFIG, ParallelPlan(), "FP32", (), (),
                                                quantization="fp8"), COSMOS3, Communicator.single(), shard).module
        assert relative_error(fp8(**inputs)["sample"], want) < 0.1


def test_compiled_regions_answer_as_eager_and_never_compile_after_the_load():
    """What GPU ranks run (each layer's vision attention and MLP compiled, warmed up at load), on CPU: the same
    velocity at lengths the warm-up did not have, whole and through First Block Cache's parts, with no new graph."""
    manifest = Manifest("cosmos3", TINY_CONFIG, ParallelPlan(), "FP32", (), ())
    weights = random_weights("cosmos3", TINY_CONFIG, seed=4)
    eager = TorchEngine.from_weights(manifest, COSMOS3, Communicator.single(), dict(weights), compile=False)
    compiled = TorchEngine.from_weights(manifest, COSMOS3, Communicator.single(), weights, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    for seed, case in enumerate(CASES):
        inputs = engine_inputs(diffusers_inputs(TINY_CONFIG, case, seed))
        want = eager.forward(inputs)["sample"]
        assert max_relative_error(compiled.forward(inputs)["sample"], want) < 1e-5
        cache = StepCache(FirstBlockCache(threshold=0.0))
        assert max_relative_error(compiled.forward(inputs, cache)["sample"], want) < 1e-5
        assert max_relative_error(compiled.forward(inputs, cache)["sample"], want) < 1e-5
    assert counters["stats"]["unique_graphs"] == graphs, "a request after the warm-up compiled again"


@pytest.mark.timeout(300)
def test_the_transformer_engine_served_on_two_ranks_answers_as_one_process(tmp_path):
    """`mdtriton build --architecture cosmos3` (tp 2 x cp 1 would not split the sequence: cp 2, ulysses), served by
    Triton: its warm-up request (the family's sample) passes the request check, and a request with padding and a
    conditioning frame equals the one-rank module."""
    assert main(["build", str(tmp_path / "repository"), "--name", "cosmos3", "--architecture", "cosmos3", "--cp", "2",
                 "--cp-method", "ulysses", "--seed", "7"]) == 0
    inputs = engine_inputs(diffusers_inputs(TINY_CONFIG, CASES[0], seed=3))
    module = reference_module("cosmos3", TINY_CONFIG, random_weights("cosmos3", TINY_CONFIG, 7), "FP32")
    with torch.inference_mode():
        expected = module(**inputs)["sample"]
    server = start_server(tmp_path / "repository", tmp_path / "server.log")
    try:
        with Client(server.grpc_address) as client:
            sample = client.infer("cosmos3", inputs)["sample"]
            with pytest.raises(ClientError, match="noisy_frames has 2 values for 3 latent frames"):
                client.infer("cosmos3", {**inputs, "noisy_frames": inputs["noisy_frames"][:2]})
    finally:
        server.stop()
    assert max_relative_error(torch.tensor(sample), expected) < 1e-4
