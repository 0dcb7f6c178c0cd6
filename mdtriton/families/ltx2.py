"""LTX-2 served as one model ("ltx2-pipeline"): diffusers' LTX2Pipeline, prompt to video with sound, its
LTX2VideoTransformer3DModel split by sequence as diffusers declares, mended (mdtriton.pipeline.generic).
"""

from __future__ import annotations

import torch


def ltx2_context_parallel_plan(transformer: torch.nn.Module) -> dict:
    """LTX2VideoTransformer3DModel's `_cp_plan`, mended: its video RoPE is split along the tokens in either of its
    layouts ([B, tokens, D] interleaved, [B, heads, tokens, D/2] split: the declared plan splits only the first), and
    so is the RoPE of its audio-video cross-attention's video side (`cross_attn_rope`, which the declared plan leaves
    whole beside the split video queries and keys). The audio stream is not split: every rank holds it whole."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    plan = dict(type(transformer)._cp_plan)
    if transformer.config.rope_type == "split":
        tokens = ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
        plan["rope"] = {0: tokens, 1: tokens}
    plan["cross_attn_rope"] = plan["rope"]
    return plan
