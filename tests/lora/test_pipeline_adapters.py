"""LoRA adapters in the pipeline engine against diffusers, on one rank and on every kind of plan (gloo ranks).

With the same components and seed, a request naming two adapters with their scales gives diffusers' FluxPipeline image
after `load_lora_weights(..., adapter_name=NAME)` for each and `set_adapters(names, scales)`, within one uint8 level:
tensor parallelism (each adapter's factors split as the weights they change), context parallelism, and both. The
adapters come in diffusers' format (one of them with network alphas of two values) and in kohya's (q/k/v joined under
BFL's names, with an alpha), converted by diffusers' own loader. A request without adapters after them gets exactly the
first base image, and a request naming the same adapters again exactly the same adapted image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from mdtriton.build_tools.adapters import add_adapter
from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError
from mdtriton.lora.directory import adapters_dir
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import check_request
from tests.distributed import run_ranks
from tests.lora.adapters import diffusers_lora, kohya_lora, loras_input, rank_engine, with_adapters
from tests.pipeline.pipelines import max_level_difference, reference_image, save_pipelines
from tests.pipeline.test_flux_pipeline_engine import request

PROMPTS, SIZE, STEPS, GUIDANCE, SEED = ["a red cat with a sign"], (48, 80), 4, 3.5, 7
# The requests each rank runs, in order: (name of the expected image, the adapters and their scales).
REQUESTS = [("base", {}), ("mixed", {"style": 0.7, "detail": -0.5}), ("kohya", {"kohya": 0.8}),
            ("mixed", {"style": 0.7, "detail": -0.5}), ("base", {})]
PLANS = {
    "tp2": ParallelPlan(tp_size=2),
    "ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"),
    "tp2_ring2": ParallelPlan(tp_size=2, cp_size=2, cp_method="ring"),
}


def adapted_reference_image(pipeline_dir, files: dict, scales: dict[str, float]) -> np.ndarray:
    """diffusers' FluxPipeline image with each adapter loaded under its name and set to its scale."""
    pipeline = with_adapters(FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True), files, scales)
    images = pipeline(PROMPTS, height=SIZE[0], width=SIZE[1], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                      generator=torch.Generator().manual_seed(SEED), output_type="np").images
    return (images * 255).round().astype(np.uint8)


def run_requests(rank: int, world_size: int, engine_dir: str, directory: str) -> list[np.ndarray]:
    """On one rank: REQUESTS' images, in order."""
    engine = rank_engine(rank, engine_dir, directory)
    inputs = request(PROMPTS, *SIZE, STEPS, GUIDANCE, SEED)
    return [engine.forward(loras_input(inputs, loras))["image"].numpy() for _, loras in REQUESTS]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    pipeline_dir = save_pipelines(root)["dev"]
    repository = root / "repository"
    engines = {name: build_model_version(repository, name,
                                         BuildRequest("flux-pipeline", None, plan, "FP32", "cpu",
                                                      weights_path=pipeline_dir, progress=False)) / ENGINE_DIR
               for name, plan in {"one": ParallelPlan(), **PLANS}.items()}
    transformer = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True).transformer
    files = {"style": diffusers_lora(root / "style.safetensors", transformer, seed=1, rank=4),
             "detail": diffusers_lora(root / "detail.safetensors", transformer, seed=2, rank=2, alphas=(1.0, 4.0)),
             "kohya": kohya_lora(root / "kohya.safetensors", transformer, seed=3, rank=4, alpha=2.0)}
    for name, path in files.items():
        add_adapter(repository, "one", path, name)
    expected = {"base": reference_image(pipeline_dir, PROMPTS, *SIZE, STEPS, GUIDANCE, SEED)}
    for name, loras in REQUESTS[1:3]:
        expected[name] = adapted_reference_image(pipeline_dir, files, loras)
    return engines, str(adapters_dir(repository / "one")), expected


def check_images(images: list[np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for (name, _), image in zip(REQUESTS, images):
        assert max_level_difference(image, expected[name]) <= 1, name
    for name in ("mixed", "kohya"):
        assert max_level_difference(expected[name], expected["base"]) > 8, name  # the adapters change the image
    assert np.array_equal(images[4], images[0])  # exactly the base weights back
    assert np.array_equal(images[3], images[1])  # the same adapters, merged again


@pytest.mark.timeout(300)
def test_one_rank_equals_diffusers_with_the_adapters(adapted):
    engines, directory, expected = adapted
    check_images(run_requests(0, 1, str(engines["one"]), directory), expected)


@pytest.mark.timeout(600)
def test_every_plan_splits_the_adapters_as_the_weights(adapted):
    engines, directory, expected = adapted
    for name, plan in PLANS.items():
        for images in run_ranks(plan.world_size, run_requests, str(engines[name]), directory):
            check_images(images, expected)


@pytest.mark.parametrize("loras, message", [
    ('{"style": 0.5, "nosuch": 1}', "this model has no adapter 'nosuch'; its adapters: detail, kohya, style"),
    ('{"style": NaN}', "loras: the scale of 'style' is NaN; send a number from -10 to 10"),
    ('{"style": 1e999}', "loras: the scale of 'style' is Infinity; send a number from -10 to 10"),
    ('{"style": "0.5"}', "loras: the scale of 'style' is \"0.5\"; send a number from -10 to 10"),
    ('{"style": true}', "loras: the scale of 'style' is true; send a number from -10 to 10"),
    ("{style: 1}", "loras is not JSON"),
    ('["style"]', "loras is an array, not a JSON object"),
    ('"style"', "loras is a string, not a JSON object"),
    ('{"../style": 1}', "loras: adapter name '../style': use 1 to 100 letters"),
])
def test_bad_adapter_requests_are_refused_before_the_ranks(adapted, loras, message):
    engines, directory, _ = adapted
    inputs = {**request(PROMPTS, *SIZE, STEPS, GUIDANCE, SEED),
              "loras": torch.from_numpy(prompt_tensor([loras], "loras"))}
    with pytest.raises(RequestError) as refused:
        check_request(Manifest.read(engines["one"]), inputs, adapters_dir(engines["one"].parent.parent))
    assert message in str(refused.value)
