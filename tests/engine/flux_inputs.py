"""Random FLUX inputs with diffusers' names and shapes, for the tiny config."""

from __future__ import annotations

import torch


def flux_inputs(config: dict, text_len: int, image_len: int, batch: int = 2, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inputs as the FLUX pipeline makes them: image ids on a (0, row, column) grid; text ids random here
    (zeros in the pipeline) so that a text token's position matters to the test."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(image_len)
    img_ids = torch.stack((torch.zeros(image_len), positions // 4, positions % 4), dim=1).float()
    inputs = {
        "hidden_states": torch.randn(batch, image_len, config["in_channels"], generator=generator, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator,
                                             dtype=dtype),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator, dtype=dtype),
        "timestep": torch.rand(batch, generator=generator, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.randint(0, 8, (text_len, 3), generator=generator).float(),
    }
    if config["guidance_embeds"]:
        inputs["guidance"] = 1 + 4 * torch.rand(batch, generator=generator, dtype=dtype)
    return inputs


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
