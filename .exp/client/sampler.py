"""A FLUX flow-matching sampler on the client: N Euler steps, each one request to the served transformer.

The schedule and step are those of diffusers' FluxPipeline with FlowMatchEulerDiscreteScheduler
(FLUX.1-dev's scheduler config): sigmas linspace(1, 1/N, N), shifted by mu, which grows with the
number of image tokens; the transformer gets `timestep` = sigma in [0, 1] (it multiplies by 1000
itself) and `guidance` = the guidance scale; each step moves the latents by (sigma_next - sigma) times
the predicted velocity. Latents are "packed" as the pipeline packs them: [batch, (H/16)*(W/16),
in_channels] for an image of H x W pixels; the result is what FluxPipeline returns with
output_type="latent" (decode it with the pipeline's _unpack_latents and the VAE).

One difference from diffusers: the latents stay float32 between steps here (diffusers keeps them in
the transformer's dtype); the transformer still receives them in its own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

# Pixels per latent token: the VAE downsamples by 8 and the pipeline packs 2 x 2 latent pixels into a token.
PIXELS_PER_TOKEN = 16


@dataclass(frozen=True)
class TimeShift:
    """Resolution-dependent shift of the schedule (FLUX.1-dev's scheduler config).

    mu rises linearly from base_shift at base_tokens image tokens to max_shift at max_tokens.
    """

    base_tokens: int = 256
    max_tokens: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def mu(self, image_tokens: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_tokens - self.base_tokens)
        return image_tokens * slope + self.base_shift - slope * self.base_tokens


def flow_match_sigmas(steps: int, image_tokens: int, shift: TimeShift = TimeShift()) -> np.ndarray:
    """The noise levels of a run: steps + 1 float32 values falling from 1 to the final 0."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    sigmas = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    mu = shift.mu(image_tokens)
    shifted = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
    return np.append(shifted.astype(np.float32), np.float32(0.0))


def image_ids(height_tokens: int, width_tokens: int) -> np.ndarray:
    """Position ids of the packed image tokens, row by row: (0, row, column), float32 [h * w, 3]."""
    rows, columns = np.meshgrid(np.arange(height_tokens), np.arange(width_tokens), indexing="ij")
    ids = np.stack((np.zeros_like(rows), rows, columns), axis=-1)
    return ids.reshape(-1, 3).astype(np.float32)


def euler_loop(predict: Callable[[np.ndarray, float], np.ndarray], latents: np.ndarray, sigmas: np.ndarray,
               progress: bool = True) -> np.ndarray:
    """latents <- latents + (sigma_next - sigma) * predict(latents, sigma), for each step of sigmas."""
    latents = latents.astype(np.float32)
    for sigma, sigma_next in tqdm(list(zip(sigmas[:-1], sigmas[1:])), desc="denoising", unit="step",
                                  disable=not progress):
        velocity = np.asarray(predict(latents, float(sigma)), dtype=np.float32)
        latents = latents + (sigma_next - sigma) * velocity
    return latents


def sample_flux(client, model: str, encoder_hidden_states, pooled_projections, height: int = 1024,
                width: int = 1024, steps: int = 28, guidance: float = 3.5, latents: np.ndarray | None = None,
                seed: int = 0, version: str = "", progress: bool = True) -> np.ndarray:
    """Denoise with the served FLUX transformer `model`; return the final packed latents (float32).

    encoder_hidden_states [B, T, joint_attention_dim] and pooled_projections [B, pooled_projection_dim]
    are the prompt's text-encoder outputs (T5 and CLIP for FLUX.1). height and width are in pixels
    (multiples of 16). The starting noise is `latents` if given, else standard normal from `seed`.
    guidance is sent only to models that take a guidance input (FLUX.1-dev does; schnell does not).
    """
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"height and width must be multiples of {PIXELS_PER_TOKEN} pixels, got {height} x {width}")
    metadata = client.metadata(model, version)
    declared = {spec["name"]: spec for spec in metadata["inputs"]}
    missing = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
               "txt_ids"} - set(declared)
    if missing:
        raise ValueError(f"model {model!r} is not a FLUX transformer: it lacks input(s) {sorted(missing)}")
    encoder_hidden_states = np.asarray(encoder_hidden_states, dtype=np.float32)
    batch, text_tokens = encoder_hidden_states.shape[:2]
    height_tokens, width_tokens = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    channels = int(declared["hidden_states"]["shape"][-1])
    shape = (batch, height_tokens * width_tokens, channels)
    if latents is None:
        latents = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    elif tuple(latents.shape) != shape:
        raise ValueError(f"latents must have shape {list(shape)} for {height} x {width} pixels, "
                         f"got {list(latents.shape)}")
    fixed = {
        "encoder_hidden_states": encoder_hidden_states,
        "pooled_projections": np.asarray(pooled_projections, dtype=np.float32),
        "img_ids": image_ids(height_tokens, width_tokens),
        "txt_ids": np.zeros((text_tokens, 3), np.float32),
    }
    if "guidance" in declared:
        fixed["guidance"] = np.full((batch,), guidance, np.float32)

    def predict(current: np.ndarray, sigma: float) -> np.ndarray:
        inputs = {**fixed, "hidden_states": current, "timestep": np.full((batch,), sigma, np.float32)}
        return client.infer(model, inputs, version)["sample"]

    sigmas = flow_match_sigmas(steps, height_tokens * width_tokens)
    return euler_loop(predict, latents, sigmas, progress)
