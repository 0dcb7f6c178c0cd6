"""The VAE decode split across gloo ranks by bands of rows (mdtriton.pipeline.split_vae) equals the one-rank decode of
the same latent: FLUX's AutoencoderKL and Wan's causal AutoencoderKLWan (the tiny pipelines' VAEs, and a tiny one of
Wan 2.2's layout: residual up blocks, patches), on 2 and 3 ranks, with rows that do not divide by the ranks, and
whole on every rank when there are fewer rows than ranks."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.split_vae import split_decode
from tests.distributed import run_ranks
from mdtriton.testing.tiny_flux_pipeline import tiny_flux_pipeline
from mdtriton.testing.tiny_wan_pipeline import tiny_wan_pipeline

LATENTS = {  # [batch, channels, (latent frames,) rows, columns]: 7 and 5 rows split unevenly over 2 and 3 ranks
    "flux": (2, 2, 7, 5),
    "wan": (1, 4, 3, 5, 6),
    "wan2.2": (1, 4, 3, 5, 6),
}


def tiny_vae(kind: str) -> torch.nn.Module:
    """The tiny pipeline's VAE, or a tiny one of Wan 2.2's layout (seeded: the same weights on every rank)."""
    if kind == "wan2.2":
        torch.manual_seed(0)
        return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, is_residual=True,
                                temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2,
                                scale_factor_spatial=16, latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    return (tiny_flux_pipeline() if kind == "flux" else tiny_wan_pipeline()).vae.eval()


def levels(image: torch.Tensor) -> torch.Tensor:
    """The uint8 levels of a decoded image in [-1, 1], rounded as diffusers' image processor rounds them."""
    return ((image / 2 + 0.5).clamp(0, 1) * 255).round()


def _whole_and_split(rank: int, world_size: int, cases: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """Each case's (VAE, latent shape) decoded by this rank alone, then split across the ranks, and the bands."""
    comm = Communicator(ParallelPlan(cp_size=world_size), rank, torch.device("cpu"))
    comm.join_groups()
    results = {}
    for name, (kind, latent_shape) in cases.items():
        vae = tiny_vae(kind)
        latent = torch.randn(latent_shape, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            whole = vae.decode(latent).sample
            assert split_decode(vae, comm)
            split = vae.decode(latent).sample
        results[name] = {"whole": whole, "split": split, "bands": vae.decoder.mid_block.bands.sizes}
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_decode_equals_the_one_rank_decode(world_size):
    """Every VAE (one set of ranks for all: each start costs seconds), and on 3 ranks a latent of 2 rows."""
    cases = {kind: (kind, shape) for kind, shape in LATENTS.items()}
    if world_size == 3:
        cases["too few rows"] = ("flux", (1, 2, 2, 5))
    results = run_ranks(world_size, _whole_and_split, cases)
    for name, (kind, shape) in cases.items():
        rows = shape[-2]
        bands = [rows // world_size + (r < rows % world_size) for r in range(world_size)] if rows >= world_size else []
        assert results[0][name]["bands"] == bands, name  # fewer rows than ranks: every rank decodes the whole
        for rank_results in results:
            result = rank_results[name]
            assert result["split"].shape == result["whole"].shape
            assert (result["split"] - result["whole"]).abs().max() < 1e-5, name
            assert (levels(result["split"]) - levels(result["whole"])).abs().max() <= 1, name


def test_one_rank_is_left_whole():
    vae = tiny_vae("flux")
    assert not split_decode(vae, Communicator.single())
    assert type(vae.decoder.mid_block).__name__ == "UNetMidBlock2D"
