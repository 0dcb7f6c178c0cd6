"""Cosmos 3 test material: diffusers' Cosmos3OmniTransformer with random weights, requests packed as
Cosmos3OmniPipeline packs them (text first, then the video; 3D rotary positions by diffusers' own helpers), and both
models' outputs for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Cosmos3OmniTransformer
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import get_3d_mrope_ids_text_tokens, get_3d_mrope_ids_vae_tokens

from mdtriton.families.cosmos3 import COSMOS3

# The Nemotron backbone's layout (relu2 MLP without a gate, Nemotron's norms, no text q/k norms but a key norm for the
# vision tokens' view of the text).
NEMOTRON = {"hidden_act": "relu2", "qk_norm_for_text": False, "use_und_k_norm_for_gen": True}


@dataclass(frozen=True)
class Case:
    """A request: text tokens, latent frames, latent height and width, conditioning frames at the start, fps."""

    text: int
    frames: int
    height: int
    width: int
    conditioning: int = 0
    fps: float = 24.0


def diffusers_model(config: dict, seed: int) -> Cosmos3OmniTransformer:
    """diffusers' model with random weights, its norms moved off 1 (so a norm weight applied to the wrong heads
    shows)."""
    torch.manual_seed(seed)
    model = Cosmos3OmniTransformer(**config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model


def diffusers_inputs(config: dict, case: Case, seed: int) -> dict:
    """diffusers' call of its transformer for the case, as Cosmos3OmniPipeline makes it."""
    generator = torch.Generator().manual_seed(seed)
    p = config["latent_patch_size"]
    grid = (case.frames, -(-case.height // p), -(-case.width // p))
    video = grid[0] * grid[1] * grid[2]
    text_positions, offset = get_3d_mrope_ids_text_tokens(case.text, 0, use_float_positions=True)
    video_positions, _ = get_3d_mrope_ids_vae_tokens(*grid, offset + config["unified_3d_mrope_temporal_modality_margin"],
                                                     fps=case.fps, base_fps=float(config["base_fps"]))
    noisy = torch.arange(case.conditioning, case.frames)
    per_frame = grid[1] * grid[2]
    return {
        "input_ids": torch.randint(0, config["vocab_size"], (case.text,), generator=generator),
        "text_indexes": torch.arange(case.text),
        "position_ids": torch.cat((text_positions, video_positions), dim=1),
        "und_len": case.text,
        "sequence_length": case.text + video,
        "vision_tokens": [torch.randn(1, config["latent_channel"], case.frames, case.height, case.width,
                                      generator=generator)],
        "vision_token_shapes": [grid],
        "vision_sequence_indexes": torch.arange(case.text, case.text + video),
        "vision_mse_loss_indexes": torch.arange(case.text + case.conditioning * per_frame, case.text + video),
        "vision_timesteps": torch.full((len(noisy) * per_frame,), 1000 * torch.rand(1, generator=generator).item()),
        "vision_noisy_frame_indexes": [noisy],
        "return_dict": False,
    }


def engine_inputs(call: dict) -> dict[str, torch.Tensor]:
    """Our transformer engine's inputs for a diffusers call."""
    latent = call["vision_tokens"][0]
    noisy = torch.zeros(latent.shape[2])
    noisy[call["vision_noisy_frame_indexes"][0]] = 1.0
    return {"input_ids": call["input_ids"], "position_ids": call["position_ids"].float(), "vision_tokens": latent,
            "timestep": call["vision_timesteps"][:1], "noisy_frames": noisy}


def expected_sample(model: Cosmos3OmniTransformer, call: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**call)[0][0]


def module_weights(model: Cosmos3OmniTransformer) -> dict[str, torch.Tensor]:
    """diffusers' weights without those the family does not load."""
    return {name: tensor for name, tensor in model.state_dict().items() if not name.startswith(COSMOS3.unused_weights)}
