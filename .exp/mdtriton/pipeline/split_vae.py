"""The VAE decode split across the ranks by bands of rows (patch parallelism, as xDiT's DistVAE splits it).

Every rank runs the whole pipeline, so every rank would decode the whole image or clip. Split, the decoder's low
resolution part (its input convolution and middle block, attention included: a few per cent of the work) still runs
whole on every rank; from the middle block's output on, world rank r keeps its band r of rows (uneven where the rows
do not divide by the ranks), and the up blocks and the output layers run on the band alone, exactly as on the whole:
- each convolution that reaches over rows first takes its neighbours' edge rows (`Communicator.halo_exchange`; zeros
  at the image's top and bottom, as its own zero padding);
- each GroupNorm (FLUX's VAE) sums its statistics over the ranks (`Communicator.all_reduce`); Wan's RMS norm is per
  position and needs nothing;
- upsampling (nearest, x2) maps a band onto a band, and every other layer of these decoders works per position;
- the output convolution's rows are gathered on every rank (`Communicator.all_gather`), so the decoder answers whole.
Wan's causal decoder runs latent frame by latent frame with a cache of earlier frames per convolution: each rank's
caches hold its band, and a convolution's halo is taken after its cached frames are put before the new ones. Frames
are not split: the cache makes every chunk depend on every earlier one.

Fallback: when the latent has fewer rows than the world has ranks, every rank decodes the whole (the same on every
rank, so no rank waits on another). Decoders other than diffusers' AutoencoderKL (FLUX) and AutoencoderKLWan (Wan 2.1
and 2.2) are left whole.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from torch import nn

from mdtriton.engine.comm import Communicator

log = logging.getLogger(__name__)

ROWS = -2  # the rows' dimension: [B, C, H, W] images (FLUX, and Wan's per-frame upsampling) and [B, C, T, H, W] clips


class RowBands:
    """The bands of this decode: world rank r's rows of the middle block's output, set at each decode."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.sizes: list[int] = []  # rows per rank at the middle block's resolution; empty: not split

    @property
    def split(self) -> bool:
        return bool(self.sizes)

    def cut(self, rows: int) -> tuple[int, int]:
        """Set the bands of `rows` rows (none if there are fewer rows than ranks) and return this rank's (start,
        length); the first rows % world_size ranks take one row more."""
        world_size = self.comm.plan.world_size
        if rows < world_size:
            self.sizes = []
            return 0, rows
        self.sizes = [rows // world_size + (r < rows % world_size) for r in range(world_size)]
        rank = self.comm.rank
        return sum(self.sizes[:rank]), self.sizes[rank]

    def scaled(self, local_rows: int) -> list[int]:
        """Every rank's rows at the resolution where this rank has local_rows (the decoder upsamples every band by the
        same factor)."""
        factor = local_rows // self.sizes[self.comm.rank]
        return [size * factor for size in self.sizes]


class BandOfRows(nn.Module):
    """The middle block, run whole on every rank, then this rank's band of its output rows."""

    def __init__(self, block: nn.Module, bands: RowBands):
        super().__init__()
        self.block, self.bands = block, bands

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.block(*args, **kwargs)
        start, length = self.bands.cut(out.shape[ROWS])
        return out.narrow(ROWS, start, length) if self.bands.split else out


class HaloConv2d(nn.Module):
    """A Conv2d (stride 1 along rows, zero padding) on a band: its neighbours' rows in place of its row padding."""

    def __init__(self, conv: nn.Conv2d, bands: RowBands):
        super().__init__()
        self.conv, self.bands = conv, bands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if not self.bands.split:
            return conv(x)
        x = self.bands.comm.halo_exchange(x, ROWS, conv.padding[0])
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, (0, conv.padding[1]), conv.dilation, conv.groups)


class HaloCausalConv3d(nn.Module):
    """Wan's causal Conv3d on a band: as WanCausalConv3d.forward (the cached frames before x, zero padding), with
    its neighbours' rows, cached frames included, in place of its row padding."""

    def __init__(self, conv: WanCausalConv3d, bands: RowBands):
        super().__init__()
        self.conv, self.bands = conv, bands

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        conv = self.conv
        if not self.bands.split:
            return conv(x, cache_x)
        padding = list(conv._padding)  # (left, right, top, bottom, front, back)
        if cache_x is not None and padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        halo = padding[2]
        padding[2] = padding[3] = 0
        x = self.bands.comm.halo_exchange(F.pad(x, padding), ROWS, halo)
        return nn.Conv3d.forward(conv, x)


class SplitGroupNorm(nn.Module):
    """A GroupNorm over every rank's band: mean and variance from sums over the world, in float32."""

    def __init__(self, norm: nn.GroupNorm, bands: RowBands):
        super().__init__()
        self.norm, self.bands = norm, bands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, comm = self.norm, self.bands.comm
        if not self.bands.split:
            return norm(x)
        grouped = x.float().reshape(x.shape[0], norm.num_groups, -1)
        count = grouped.shape[-1] // x.shape[ROWS] * sum(self.bands.scaled(x.shape[ROWS]))
        mean = comm.all_reduce(grouped.sum(-1)) / count
        centered = grouped - mean[..., None]
        variance = comm.all_reduce(centered.square().sum(-1)) / count
        out = (centered * torch.rsqrt(variance + norm.eps)[..., None]).reshape(x.shape)
        if norm.affine:
            channels = (1, -1) + (1,) * (x.ndim - 2)
            out = out * norm.weight.float().view(channels) + norm.bias.float().view(channels)
        return out.to(x.dtype)


class GatheredRows(nn.Module):
    """The output layer on the band, then every rank's rows, gathered on every rank."""

    def __init__(self, layer: nn.Module, bands: RowBands):
        super().__init__()
        self.layer, self.bands = layer, bands

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.layer(*args, **kwargs)
        if not self.bands.split:
            return out
        return self.bands.comm.all_gather(out, ROWS, self.bands.scaled(out.shape[ROWS]))


def split_rows(module: nn.Module, bands: RowBands) -> nn.Module:
    """module with its row-reaching layers made band-aware (itself if it is one): convolutions whose kernels span
    rows take halos, GroupNorms sum over the ranks."""
    if isinstance(module, WanCausalConv3d):
        return HaloCausalConv3d(check_conv(module, module._padding[2]), bands) if module._padding[2] else module
    if isinstance(module, nn.Conv2d):
        return HaloConv2d(check_conv(module, module.padding[0]), bands) if module.padding[0] else module
    if isinstance(module, nn.GroupNorm):
        return SplitGroupNorm(module, bands)
    for name, child in module.named_children():
        setattr(module, name, split_rows(child, bands))
    return module


def check_conv(conv: nn.Conv2d | nn.Conv3d, row_padding: int) -> nn.Module:
    """A convolution a band can run: stride 1 and zero padding over rows, a kernel that reaches no farther than that
    padding (so the halo is the padding)."""
    row_kernel = conv.kernel_size[-2] * conv.dilation[-2] - conv.dilation[-2] + 1
    if conv.stride[-2] != 1 or conv.padding_mode != "zeros" or row_kernel != 2 * row_padding + 1:
        raise ValueError(f"a {type(conv).__name__} of stride {conv.stride}, padding {conv.padding_mode} and kernel "
                         f"{conv.kernel_size} cannot run on a band of rows; the VAE decode cannot be split")
    return conv


def split_decode(vae: nn.Module, comm: Communicator) -> bool:
    """Make the VAE's decode split across the world's ranks (see the module's docstring), in place; whether it is
    (one rank, or a VAE of another kind, decodes whole)."""
    if comm.plan.world_size == 1 or not isinstance(vae, (AutoencoderKL, AutoencoderKLWan)):
        return False
    decoder, bands = vae.decoder, RowBands(comm)
    norm_out = "norm_out" if isinstance(vae, AutoencoderKLWan) else "conv_norm_out"
    decoder.mid_block = BandOfRows(decoder.mid_block, bands)
    decoder.up_blocks = split_rows(decoder.up_blocks, bands)
    setattr(decoder, norm_out, split_rows(getattr(decoder, norm_out), bands))
    decoder.conv_out = GatheredRows(split_rows(decoder.conv_out, bands), bands)
    log.info("VAE decode split across %d ranks by bands of rows", comm.plan.world_size)
    return True
