"""Engine architecture "flux": the FLUX.1 diffusion transformer (diffusers' FluxTransformer2DModel),
tensor-parallel by heads and context-parallel by tokens of the joint [text; image] sequence.

Parameter names equal diffusers' state-dict keys, so a diffusers checkpoint loads without conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import attention_for
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.models.flux_blocks import FluxSingleTransformerBlock, FluxTransformerBlock
from mdtriton.engine.models.flux_layers import AdaLayerNormContinuous, TimeTextEmbedding, rotary_embedding
from mdtriton.engine.plan import ParallelPlan

# FLUX.1-dev's transformer, as its diffusers config (out_channels None means in_channels).
FLUX_DEV_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}

# A few-hundred-thousand-parameter FLUX for tests: same structure, tiny sizes.
TINY_CONFIG = {
    "patch_size": 1,
    "in_channels": 8,
    "out_channels": None,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}


@dataclass(frozen=True)
class JointSlice:
    """This context-parallel rank's tokens of the joint [text; image] sequence.

    The sequence is padded at its end to a multiple of cp_size; rank r holds positions
    [r * local_len, (r + 1) * local_len): text positions first, then image, then padding.
    """

    text_len: int
    image_len: int
    local_len: int
    start: int

    @classmethod
    def of(cls, text_len: int, image_len: int, comm: Communicator) -> "JointSlice":
        local_len = -(-(text_len + image_len) // comm.cp_size)
        return cls(text_len, image_len, local_len, comm.cp_rank * local_len)

    @property
    def valid_len(self) -> int:
        """Real (unpadded) tokens in the joint sequence."""
        return self.text_len + self.image_len

    @property
    def padded_len(self) -> int:
        return self.local_len * (self.start // self.local_len + 1) if False else None  # replaced below

    def text_range(self) -> tuple[int, int]:
        """This rank's text tokens, as a range of text positions."""
        return min(self.start, self.text_len), min(self.start + self.local_len, self.text_len)

    def image_range(self) -> tuple[int, int]:
        """This rank's image tokens, as a range of image positions."""
        first, end = self.start - self.text_len, self.start + self.local_len - self.text_len
        return min(max(first, 0), self.image_len), min(max(end, 0), self.image_len)

    def padding(self) -> int:
        """How many padding tokens this rank holds after its real ones."""
        return self.start + self.local_len - max(self.start, self.valid_len) if self.start + self.local_len > self.valid_len else 0
