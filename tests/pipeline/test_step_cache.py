"""Step caching (mdtriton.engine.step_cache) against diffusers' own cache hooks.

With the same components, seed and cache config (First Block Cache, TaylorSeer), the image of our pipeline engine
equals diffusers' FluxPipeline after `pipe.transformer.enable_cache(config)` within one uint8 level, and as many
steps ran the whole transformer, on one rank and on every plan: tensor parallelism, each context-parallel method
(where every rank holds part of the tokens, so the decision's sums are added across ranks) and tp x cp. The tiny
pipeline at threshold 0.35 runs 3 of 8 steps whole (5 at 0.3, all 8 at 0.25), and its image then differs from the
uncached one by up to 3 levels: the decisions are a mix, and a rank that decided alone would run blocks (and their
collectives) the others skip, and hang or diverge. TaylorSeer (5, 1, None, 1) computes at steps 0, 2 and 7 (3 of
8) and predicts every attention's outputs at the others, up to 4 steps ahead; its image differs from the uncached one
by up to 2 levels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError
from mdtriton.engine.step_cache import FirstBlockCache, TaylorSeer, read_cache
from mdtriton.pipeline.prompts import prompt_tensor
from mdtriton.serving import check_request, load_engine, with_defaults
from tests.distributed import run_ranks
from tests.pipeline.pipelines import cached_reference_image, max_level_difference, reference_image, save_pipelines
from tests.pipeline.test_flux_pipeline_engine import request

PROMPTS, SIZE, STEPS, GUIDANCE, SEED = ["a red cat with a sign"], (48, 80), 8, 3.5, 7
CACHES = {  # ours, diffusers', full steps
    "first_block": ('{"method": "first_block", "threshold": 0.35}', FirstBlockCacheConfig(threshold=0.35), 3),
    "taylorseer": ('{"method": "taylorseer", "cache_interval": 5, "disable_cache_before_step": 1}',
                   TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=1), 3),
}
PLANS = {
    "tp2": ParallelPlan(tp_size=2),
    "ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"),
    "ring2": ParallelPlan(cp_size=2, cp_method="ring"),
    "allgather_kv2": ParallelPlan(cp_size=2, cp_method="allgather_kv"),
    "tp2_ring2": ParallelPlan(tp_size=2, cp_size=2, cp_method="ring"),
}


def cached(inputs: dict[str, torch.Tensor], cache: str) -> dict[str, torch.Tensor]:
    return {**inputs, "cache": torch.from_numpy(prompt_tensor([cache], "cache"))}


def run_cached_then_uncached(rank: int, world_size: int, engine_dirs: list[str]) -> list[dict]:
    """On one rank, for each engine in turn (one set of rank processes for all) and each cache: the cached request,
    then the same request without a cache (image, full_steps) each."""
    return [cached_then_uncached(rank, engine_dir) for engine_dir in engine_dirs]


def cached_then_uncached(rank: int, engine_dir: str) -> dict[str, list[tuple[np.ndarray, int]]]:
    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, torch.device("cpu"))
    comm.join_groups()
    engine = load_engine(engine_dir, manifest, comm)
    inputs = request(PROMPTS, *SIZE, STEPS, GUIDANCE, SEED)
    results = {}
    for method, (cache, _, _) in CACHES.items():
        answers = [engine.forward(cached(inputs, cache)), engine.forward(inputs)]
        results[method] = [(answer["image"].numpy(), int(answer["full_steps"][0])) for answer in answers]
    return results


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_cache")
    pipeline_dir = save_pipelines(root)["dev"]
    engines = {name: build_model_version(root / "repository", name,
                                         BuildRequest("flux-pipeline", None, plan, "FP32", "cpu",
                                                      weights_path=pipeline_dir, progress=False)) / ENGINE_DIR
               for name, plan in {"one": ParallelPlan(), **PLANS}.items()}
    expected = {method: cached_reference_image(pipeline_dir, PROMPTS, *SIZE, STEPS, GUIDANCE, SEED, config)
                for method, (_, config, _) in CACHES.items()}
    uncached = reference_image(pipeline_dir, PROMPTS, *SIZE, STEPS, GUIDANCE, SEED)
    return engines, expected, uncached


def check_answers(results, expected, uncached) -> None:
    for method, ((image, full_steps), (after, after_full_steps)) in results.items():
        assert full_steps == expected[method][1] == CACHES[method][2], method
        assert max_level_difference(image, expected[method][0]) <= 1, method
        assert max_level_difference(image, uncached) > 1, method  # the cache changed the image
        # Nothing carries over: the next request without a cache is the uncached image, every step whole.
        assert max_level_difference(after, uncached) <= 1 and after_full_steps == STEPS, method


@pytest.mark.timeout(300)
def test_one_rank_first_block_cache_equals_diffusers(pipeline):
    engines, expected, uncached = pipeline
    check_answers(cached_then_uncached(0, str(engines["one"])), expected, uncached)


@pytest.mark.timeout(600)
def test_every_plan_takes_the_one_gpu_decisions(pipeline):
    engines, expected, uncached = pipeline
    two_rank = [str(engines[name]) for name, plan in PLANS.items() if plan.world_size == 2]
    for world_size, engine_dirs in ((2, two_rank), (4, [str(engines["tp2_ring2"])])):
        for per_engine in run_ranks(world_size, run_cached_then_uncached, engine_dirs):
            for answers in per_engine:
                check_answers(answers, expected, uncached)


def test_a_model_default_applies_to_requests_without_a_cache(pipeline):
    engines, _, _ = pipeline
    manifest = Manifest.read(engines["one"])
    inputs = request(PROMPTS, *SIZE, STEPS, GUIDANCE, SEED)
    default = CACHES["first_block"][0]
    completed = with_defaults(manifest, inputs, {"cache": default})
    assert bytes(completed["cache"][0].tolist()).decode() == default
    sent = with_defaults(manifest, cached(inputs, '{"method": "none"}'), {"cache": default})
    assert bytes(sent["cache"][0].tolist()).rstrip(b"\0").decode() == '{"method": "none"}'  # the request's wins
    assert "cache" not in with_defaults(manifest, inputs, {})
    # (served: tests/pipeline/test_served_pipeline.py; a model built with --cache: test_pipeline_build.py)


def test_configs_read_as_diffusers_names_them():
    assert read_cache('{"method": "first_block"}') == FirstBlockCache(threshold=0.05)
    assert read_cache('{"method": "first_block", "threshold": 0}') == FirstBlockCache(threshold=0)
    assert read_cache('{"method": "taylorseer", "cache_interval": 5, "disable_cache_before_step": 3, '
                      '"disable_cache_after_step": 20, "max_order": 1}') == TaylorSeer(5, 3, 20, 1)
    assert read_cache('{"method": "none"}') is None


@pytest.mark.parametrize("text, message", [
    ("{method: first_block}", "cache is not JSON"),
    ('["first_block"]', "cache is an array, not a JSON object"),
    ("null", "cache is null, not a JSON object"),
    ('{"threshold": 0.1}', "cache method None is not one of none, first_block, taylorseer"),
    ('{"method": "teacache"}', "cache method 'teacache' is not one of"),
    ('{"method": "first_block", "cache_interval": 2}', "cache field(s) cache_interval unknown to method 'first_block'"),
    ('{"method": "none", "threshold": 0.1}', "cache field(s) threshold unknown to method 'none'"),
    ('{"method": "first_block", "threshold": -0.1}', "cache threshold -0.1 is not a finite number >= 0"),
    ('{"method": "first_block", "threshold": "0.1"}', "cache threshold '0.1' is not a finite number >= 0"),
    ('{"method": "taylorseer", "cache_interval": 0}', "cache cache_interval 0 is not an integer >= 1"),
    ('{"method": "taylorseer", "max_order": 1.5}', "cache max_order 1.5 is not an integer >= 0"),
    ('{"method": "taylorseer", "disable_cache_before_step": true}', "cache disable_cache_before_step True is not"),
])
def test_bad_configs_name_the_field(pipeline, text, message):
    with pytest.raises(ValueError, match=None) as caught:
        read_cache(text)
    assert message in str(caught.value)
    engines, _, _ = pipeline  # and a request carrying it is refused before it reaches the ranks
    with pytest.raises(RequestError) as refused:
        check_request(Manifest.read(engines["one"]), cached(request(PROMPTS, *SIZE, STEPS, GUIDANCE, SEED), text))
    assert message in str(refused.value)
