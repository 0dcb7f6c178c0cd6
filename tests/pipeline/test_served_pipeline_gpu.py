"""Served pipelines on 2 GPUs (NCCL ranks), every plan of 2 ranks: tiny FLUX and Wan pipelines built for GPUs, 4
requests sent at once so that every rank receives some (rank 0 then broadcasts its answer to the receiving rank), then
20 in a row, each image or clip equal to the same pipeline's on one GPU; the VAE decode split across the ranks. Before the device contract (mdtriton.engine.comm) the answers were host tensors, which
NCCL cannot broadcast: every request another rank than 0 received failed and hung to its deadline."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mdtriton.build_tools.build import build_model_version
from mdtriton.client.pipeline import generate, generate_video
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from tests.backend.test_same_answer import received_per_rank
from tests.backend.triton_processes import rank_pids
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference, save_pipelines
from tests.pipeline.tiny_wan_pipeline import save_tiny_wan_pipeline

pytestmark = pytest.mark.gpu
FLUX_MODELS = {"flux_tp2": ParallelPlan(tp_size=2),
               **{f"flux_{method}2": ParallelPlan(cp_size=2, cp_method=method)
                  for method in ("ulysses", "ring", "allgather_kv")}}
WAN_MODELS = {"wan_cfg2": ParallelPlan(cfg_size=2), "wan_ulysses2": ParallelPlan(cp_size=2, cp_method="ulysses"),
              "wan_tp2": ParallelPlan(tp_size=2)}
IMAGE = dict(height=48, width=64, num_inference_steps=3, guidance_scale=3.5)
CLIP = dict(height=32, width=48, num_frames=9, num_inference_steps=3, guidance_scale=5.0)
SEEDS = range(4)
# A clip long enough (over a second on a GPU) for a worker to be killed in the middle of it.
LONG_CLIP = {**CLIP, "num_inference_steps": 500}
IN_A_ROW = 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = tmp_path_factory.mktemp("gpu_pipelines")
    flux = save_pipelines(root)["dev"]
    wan = save_tiny_wan_pipeline(root / "wan", "wan2.1", seed=1)
    repository = root / "repository"
    models = {"flux_1gpu": (flux, ParallelPlan()), "wan_1gpu": (wan, ParallelPlan()),
              **{name: (flux, plan) for name, plan in FLUX_MODELS.items()},
              **{name: (wan, plan) for name, plan in WAN_MODELS.items()}}
    for name, (weights, plan) in models.items():
        architecture = "flux-pipeline" if name.startswith("flux") else "wan-pipeline"
        build_model_version(repository, name, architecture, None, plan, "FP32", "gpu", progress=False,
                            weights_path=weights, limits=EngineLimits(max_batch_size=1, max_tokens=600))
    server = start_server(repository, root / "server.log")
    yield server
    server.stop()


def answers(server, model: str) -> list:
    """The model's answer for every seed, all seeds at once (so both ranks receive requests); then IN_A_ROW answers
    one by one, the seeds in turn."""
    def ask(seed):
        if model.startswith("flux"):
            return generate(server.grpc_address, model, ["a red cat"], **IMAGE, seed=seed, timeout=300)
        return generate_video(server.grpc_address, model, ["a red cat"], **CLIP, seed=seed, timeout=300)

    with ThreadPoolExecutor(len(SEEDS)) as pool:
        together = list(pool.map(ask, SEEDS))
    return together + [ask(SEEDS[i % len(SEEDS)]) for i in range(IN_A_ROW)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, models", [("flux", FLUX_MODELS), ("wan", WAN_MODELS)])
def test_every_rank_receives_requests_and_every_answer_equals_one_gpu(served, family, models):
    expected = answers(served, f"{family}_1gpu")
    assert expected[0].std() > 10  # a real picture
    for model in models:
        got = answers(served, model)
        assert len(got) == len(SEEDS) + IN_A_ROW
        for request, image in enumerate(got):
            want = expected[request % len(SEEDS)]
            assert max_level_difference(image, want) <= 2, f"{model}, request {request}"
        received = received_per_rank(served.metrics_url, model)
        assert sorted(received) == ["0", "1"] and min(received.values()) >= 1, (model, received)


@pytest.mark.timeout(600)
def test_a_worker_killed_during_a_clip_heals_and_the_clip_and_the_next_equal_the_clip_without_a_kill(
        tmp_path, rendezvous_root, server_factory):
    """SIGKILL of rank 1's worker in the middle of a served clip (tiny Wan pipeline, ulysses 2 on NCCL): the ranks heal
    in place, the clip in flight runs again on the new workers and is answered, equal to the same clip without a kill,
    and so is the next one."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    wan = save_tiny_wan_pipeline(tmp_path / "wan", "wan2.1", seed=1)
    build_model_version(tmp_path / "repository", "wan", "wan-pipeline", None, ParallelPlan(cp_size=2, cp_method="ulysses"),
                        "FP32", "gpu", progress=False, weights_path=wan, request_timeout_s=180,
                        limits=EngineLimits(max_batch_size=1, max_tokens=600))
    server = server_factory(tmp_path / "repository")

    def clip():
        return generate_video(server.grpc_address, "wan", ["a red cat"], **LONG_CLIP, seed=3, timeout=300)

    started = time.monotonic()
    expected = clip()
    took = time.monotonic() - started
    assert took > 1.0, f"the clip took {took:.2f} s: too short to kill a worker in the middle of it"
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(clip)
        time.sleep(took / 3)
        victim = rank_pids(rendezvous_root)[1]
        assert not during.done()
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        killed_clip = during.result()
    print(f"\nclip {took:.1f} s; killed rank 1's worker in the middle; the clip answered {time.monotonic() - killed:.1f} s "
          "after the kill")
    assert victim not in rank_pids(rendezvous_root).values()
    assert max_level_difference(killed_clip, expected) <= 1
    assert max_level_difference(clip(), expected) <= 1
