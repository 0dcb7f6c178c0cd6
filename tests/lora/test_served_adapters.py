"""Adapters added to a running `mdtriton serve`, as a user would: `mdtriton lora add` while the server serves a tiny
FLUX pipeline on 2 CPU ranks (tensor parallelism), then `mdtriton generate --lora`, with no reload.

Each image equals diffusers' FluxPipeline with the same adapters set to the same scales within one level; requests
with different adapters sent at once each get their own image; bad `loras` get INVALID_ARGUMENT naming what is wrong
and the server keeps serving; a removed adapter is refused from the next request on.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from diffusers import FluxPipeline
from PIL import Image
from safetensors.torch import load_file, save_file

from mdtriton.cli import main
from mdtriton.client.grpc_client import ClientError
from mdtriton.client.pipeline import generate
from tests.lora.adapters import diffusers_lora
from tests.lora.test_pipeline_adapters import adapted_reference_image
from tests.pipeline.pipelines import max_level_difference, reference_image, save_pipelines
from tests.pipeline.test_served_pipeline import post

PROMPT, SIZE, STEPS, GUIDANCE, SEED = "a red cat with a sign", (48, 80), 4, 3.5, 7
MIXED = {"style": 0.7, "detail": -0.5}


def mdtriton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mdtriton.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_lora")
    pipeline_dir = save_pipelines(root)["dev"]
    repository = root / "repository"
    assert main(["build", str(repository), "--name", "flux", "--architecture", "flux-pipeline", "--weights",
                 str(pipeline_dir), "--tp", "2"]) == 0
    transformer = FluxPipeline.from_pretrained(pipeline_dir, local_files_only=True).transformer
    files = {"style": diffusers_lora(root / "style.safetensors", transformer, seed=1, rank=4),
             "detail": diffusers_lora(root / "detail.safetensors", transformer, seed=2, rank=2, alphas=(1.0, 4.0))}
    serve = subprocess.Popen([sys.executable, "-m", "mdtriton.cli", "serve", str(repository)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        match, deadline = None, time.monotonic() + 180
        while match is None and time.monotonic() < deadline:
            match = re.search(r"ready: gRPC (\S+)  HTTP (\S+)", serve.stdout.readline())
        assert match, "serve never printed its addresses"
        address, http_address = match.groups()
        yield address, repository, pipeline_dir, files, root, http_address
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)


def image(address: str, loras=None) -> np.ndarray:
    return generate(address, "flux", PROMPT, *SIZE, STEPS, GUIDANCE, SEED, loras=loras, timeout=240)[0]


@pytest.mark.timeout(600)
def test_adapters_added_to_a_running_server_serve_the_next_request(served):
    address, repository, pipeline_dir, files, root, http_address = served
    base = image(address)
    expected_base = reference_image(pipeline_dir, [PROMPT], *SIZE, STEPS, GUIDANCE, SEED)[0]
    assert max_level_difference(base, expected_base) <= 1
    with pytest.raises(ClientError, match="INVALID_ARGUMENT.*this model has no adapter 'style'; its adapters: none"):
        image(address, {"style": 1.0})
    for name, path in files.items():
        added = mdtriton("lora", "add", str(repository), "flux", str(path), "--name", name)
        assert added.returncode == 0 and f"added {name} to flux" in added.stdout, added.stderr
    listed = mdtriton("lora", "list", str(repository), "flux")
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["detail", "style"]

    result = mdtriton("generate", "flux", PROMPT, "--url", address, "--height", str(SIZE[0]), "--width",
                      str(SIZE[1]), "--steps", str(STEPS), "--seed", str(SEED), "--lora", "style=0.7", "--lora",
                      "detail=-0.5", "-o", str(root / "mixed.png"))
    assert result.returncode == 0, result.stderr
    mixed = np.asarray(Image.open(root / "mixed.png"))
    expected_mixed = adapted_reference_image(pipeline_dir, files, MIXED)[0]
    assert max_level_difference(mixed, expected_mixed) <= 1
    assert max_level_difference(expected_mixed, expected_base) > 8
    # Triton's /generate over HTTP/JSON: the adapters as a JSON string.
    status, answer = post(f"http://{http_address}/v2/models/flux/generate",
                          {"prompt": PROMPT, "height": SIZE[0], "width": SIZE[1], "num_inference_steps": STEPS,
                           "seed": SEED, "loras": json.dumps(MIXED)})
    assert status == 200, answer
    assert np.array_equal(np.array(answer["image"], np.uint8).reshape(*SIZE, 3), mixed)

    # Requests with other adapters, sent together, never share a forward: each gets its own image (the base one and
    # the mixed one exactly as before: the base weights are put back, the same merge gives the same weights).
    expected = {"none": (None, base), "mixed": (MIXED, mixed),
                "style": ({"style": 1.0}, adapted_reference_image(pipeline_dir, files, {"style": 1.0})[0])}
    order = ["none", "mixed", "style", "none", "mixed", "style"]
    with ThreadPoolExecutor(len(order)) as pool:
        images = list(pool.map(lambda kind: image(address, expected[kind][0]), order))
    for kind, picture in zip(order, images):
        if kind == "style":
            assert max_level_difference(picture, expected[kind][1]) <= 1
        else:
            assert np.array_equal(picture, expected[kind][1]), kind


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loras, message", [
    ('{"nosuch": 1}', "this model has no adapter 'nosuch'"),
    ('{"style": NaN}', "loras: the scale of 'style' is NaN; send a number from -10 to 10"),
    ('{"style": 1e30}', "loras: the scale of 'style' is 1e+30; send a number from -10 to 10"),
    ('{"style": 0.5', "loras is not JSON"),
    ('{"style": ' + "[" * 3000 + "]" * 3000 + "}", "loras nests arrays or objects deeper than 4 levels"),
    ('{"style": 1' + "0" * 5000 + "}", "loras holds an integer of 5001 digits, over the 20 taken"),
], ids=["unknown", "nan", "1e30", "not-json", "deep", "long-integer"])
def test_bad_adapter_requests_get_invalid_argument_and_the_server_serves_on(served, loras, message):
    address = served[0]
    from mdtriton.client import pipeline

    inputs = pipeline.pipeline_inputs([PROMPT], *SIZE, STEPS, GUIDANCE, SEED)
    inputs += pipeline.infer_inputs({"loras": pipeline.texts([loras])})
    with pytest.raises(ClientError) as refused:
        pipeline.ask(address, "flux", inputs, "image", STEPS, None, None, 240)
    assert "INVALID_ARGUMENT" in str(refused.value) and message in str(refused.value)
    assert image(address).std() > 10  # served on


@pytest.mark.timeout(300)
def test_a_removed_adapter_is_refused_from_the_next_request_on(served, tmp_path):
    address, repository, _, files, *_ = served
    assert mdtriton("lora", "add", str(repository), "flux", str(files["style"]), "--name", "gone").returncode == 0
    assert image(address, {"gone": 1.0}).std() > 10
    removed = mdtriton("lora", "remove", str(repository), "flux", "gone")
    assert removed.returncode == 0 and "removed gone from flux" in removed.stdout
    with pytest.raises(ClientError, match="this model has no adapter 'gone'"):
        image(address, {"gone": 1.0})


@pytest.mark.timeout(300)
def test_latents_that_overflow_fail_the_request_naming_the_step(served, tmp_path):
    """An adapter of finite but huge factors (1e20: its update overflows float32) makes the latents infinite at the
    first step: the request fails INTERNAL saying after which step, not a flat image answered OK, and the next request
    gets the base image (its weights were put back)."""
    address, repository, *_ = served
    files = served[3]
    huge = {key: value * 1e20 for key, value in load_file(files["style"]).items()}
    save_file(huge, tmp_path / "huge.safetensors")
    assert main(["lora", "add", str(repository), "flux", str(tmp_path / "huge.safetensors"), "--name", "huge"]) == 0
    try:
        with pytest.raises(ClientError) as failed:
            image(address, {"huge": 1.0})
        assert "INTERNAL" in str(failed.value)
        assert f"the latents held NaN or infinite values after denoising step 1 of {STEPS}" in str(failed.value)
        assert image(address).std() > 10
    finally:
        assert main(["lora", "remove", str(repository), "flux", "huge"]) == 0
