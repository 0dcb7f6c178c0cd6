"""The client-side FLUX sampler: its schedule and ids against diffusers', and a served run against a local
diffusers-style loop (FlowMatchEulerDiscreteScheduler + the one-rank reference transformer, same weights).

diffusers' pipeline_flux module imports `transformers` (for the text encoders), which we do not install;
its two small helpers are restated below, the scheduler (shift and Euler step) is diffusers' own.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from diffusers import FlowMatchEulerDiscreteScheduler

from mdtriton.client.grpc_client import Client
from mdtriton.client.sampler import PIXELS_PER_TOKEN, flow_match_sigmas, image_ids, sample_flux
from tests.served_models import FLUX_CONFIG, flux_reference_module

# FLUX.1-dev's scheduler_config.json.
FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def calculate_shift(image_seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """diffusers.pipelines.flux.pipeline_flux.calculate_shift."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


def prepare_latent_image_ids(height, width):
    """diffusers' FluxPipeline._prepare_latent_image_ids."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3)


def diffusers_scheduler(steps: int, image_tokens: int) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler as FluxPipeline sets it up for a run."""
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER)
    mu = calculate_shift(image_tokens, 256, 4096, 0.5, 1.15)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler


@pytest.mark.parametrize("steps, image_tokens", [(1, 16), (4, 12), (28, 4096), (50, 1024)])
def test_sigmas_are_diffusers_flux_schedule(steps, image_tokens):
    expected = diffusers_scheduler(steps, image_tokens).sigmas.numpy()
    np.testing.assert_allclose(flow_match_sigmas(steps, image_tokens), expected, rtol=1e-6, atol=1e-7)


def test_image_ids_are_diffusers_latent_image_ids():
    expected = prepare_latent_image_ids(4, 3).numpy()
    np.testing.assert_array_equal(image_ids(4, 3), expected)


def inference_count(served, model: str) -> int:
    stats = grpcclient.InferenceServerClient(served.grpc_address).get_inference_statistics(model, as_json=True)
    return sum(int(s.get("inference_count", 0)) for s in stats["model_stats"])


def test_served_sampler_matches_a_local_diffusers_loop(served_models):
    steps, height, width, batch, text_tokens, guidance = 4, 64, 48, 2, 5, 3.5
    h, w = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randn(batch, text_tokens, FLUX_CONFIG["joint_attention_dim"], generator=generator)
    pooled = torch.randn(batch, FLUX_CONFIG["pooled_projection_dim"], generator=generator)
    noise = torch.randn(batch, h * w, FLUX_CONFIG["in_channels"], generator=generator)

    # The reference: FluxPipeline's denoising loop, in this process, with the one-rank transformer.
    transformer = flux_reference_module()
    scheduler = diffusers_scheduler(steps, h * w)
    latents = noise.clone()
    with torch.inference_mode():
        for t in scheduler.timesteps:
            velocity = transformer(hidden_states=latents, encoder_hidden_states=prompt, pooled_projections=pooled,
                                   timestep=t.expand(batch) / 1000, guidance=torch.full((batch,), guidance),
                                   img_ids=prepare_latent_image_ids(h, w),
                                   txt_ids=torch.zeros(text_tokens, 3))["sample"]
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]

    before = inference_count(served_models, "flux")
    with Client(served_models.grpc_address) as client:
        served = sample_flux(client, "flux", prompt.numpy(), pooled.numpy(), height, width, steps, guidance,
                             latents=noise.numpy(), progress=False)
    # Triton counts a request once its execute() has returned, which can be after the client has its answer.
    deadline = time.monotonic() + 10
    while inference_count(served_models, "flux") - before < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert inference_count(served_models, "flux") - before == steps  # one request per step
    assert served.shape == (batch, h * w, FLUX_CONFIG["in_channels"]) and served.dtype == np.float32
    assert np.abs(served - noise.numpy()).max() > 0.1  # it moved
    error = np.abs(served - latents.numpy()).max() / np.abs(latents.numpy()).max()
    assert error < 1e-5, f"served sampler differs from the local diffusers loop by {error:.2e}"


def test_sampler_refuses_sizes_that_are_not_whole_tokens(served_models):
    with Client(served_models.grpc_address) as client, pytest.raises(ValueError, match="multiples of 16"):
        sample_flux(client, "flux", np.zeros((1, 2, 32), np.float32), np.zeros((1, 24), np.float32), height=40)
