"""The Wan 2.x video diffusion transformer (diffusers' WanTransformer3DModel), text and image to video:
tensor-parallel by heads and context-parallel by tokens of the video's patch sequence.

Parameter names equal diffusers' state-dict keys, so a diffusers checkpoint loads without conversion, and the
modules diffusers keeps in float32 (time embedder, modulation tables, the cross-attention norm) stay in float32
in every engine (`keep_in_float32`). The text is attended by cross-attention: every rank holds all of it, so only
the video's tokens are split. The sequence is padded at its end to a multiple of cp_size (75,600 tokens of a 720p
81-frame clip do not divide by 16), the padding never attended and cut from the output.

Image to video: Wan 2.1 I2V's transformer (image_dim) embeds the image encoder's tokens (257 per image) and its
cross-attention attends them beside the text with keys and values of their own (add_k_proj, add_v_proj,
norm_added_k), split by heads like the text's; every rank holds all of them, as the text. Its input has the image's
latents and mask beside the noise (in_channels 36): a config value only. Wan 2.2 TI2V 5B given an image sends a
timestep per token (its first latent frame's tokens at 0): the modulations are then per token, computed for this
rank's tokens only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import attention_for, head_exchange_for
from mdtriton.engine.attention.ulysses import HeadExchange
from mdtriton.engine.attention.local import attention as local_attention
from mdtriton.engine.comm import Communicator
from mdtriton.engine.embeddings import MLPEmbedder, timestep_embedding
from mdtriton.engine.layers import (ColumnParallelLinear, ColumnParallelRMSNorm, RowParallelLinear, fuse_columns,
                                    sums_of_squares)
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.wan.qkv import norm_rotate_heads, packed_heads

# Wan 2.1 T2V 14B's transformer, as its diffusers config.
WAN_14B_CONFIG = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
CONFIG_KEYS = tuple(WAN_14B_CONFIG)
WAN_1_3B_CONFIG = {**WAN_14B_CONFIG, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
# Wan 2.2 TI2V 5B: 48 latent channels (its VAE compresses 16x16 pixels per token).
WAN_5B_CONFIG = {**WAN_14B_CONFIG, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                 "ffn_dim": 14336, "num_layers": 30}
# A Wan of ~140 k parameters for tests: the same structure at tiny sizes (6 heads: tp 2 or 3, ulysses 2 or 3).
TINY_CONFIG = {**WAN_14B_CONFIG, "num_attention_heads": 6, "attention_head_dim": 12, "in_channels": 4,
               "out_channels": 4, "text_dim": 16, "freq_dim": 8, "ffn_dim": 36, "num_layers": 2,
               "rope_max_seq_len": 32}
# Wan 2.1 I2V 14B (480p and 720p alike): 16 noise + 4 mask + 16 image latent channels in, CLIP ViT-H image tokens.
WAN_I2V_14B_CONFIG = {**WAN_14B_CONFIG, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}


def check_plan(config: dict, plan: ParallelPlan) -> None:
    """Raise ValueError saying what to change if config is not a Wan config or plan cannot split it."""
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"Wan config lacks {', '.join(missing)} "
                         "(its keys are those of diffusers' WanTransformer3DModel config)")
    if (config["image_dim"] is None) != (config["added_kv_proj_dim"] is None):
        raise ValueError(f"image_dim {config['image_dim']} and added_kv_proj_dim {config['added_kv_proj_dim']}: "
                         "Wan's image-to-video transformers set both (Wan 2.1 I2V: 1280 and the model's width), the "
                         "others neither")
    if config["qk_norm"] != "rms_norm_across_heads":
        raise ValueError(f"qk_norm {config['qk_norm']!r}: Wan's transformers use 'rms_norm_across_heads'")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"attention_head_dim {head_dim} must be even and at least 6 (its rotary embedding splits "
                         "it in pairs over frames, height and width)")
    plan.check_heads(heads)
    if config["ffn_dim"] % plan.tp_size:
        raise ValueError(f"ffn_dim {config['ffn_dim']} does not divide by tp_size {plan.tp_size}; choose a tp_size "
                         "that divides it")


def rotary_angles(dim: int, length: int, device: torch.device, theta: float = 10000.0) -> torch.Tensor:
    """Rotary angles [length, dim / 2] of positions 0..length-1 for dim channels, in float64 as diffusers'
    get_1d_rotary_pos_embed computes them for Wan."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device)[: dim // 2] / dim)
    return torch.outer(torch.arange(length, dtype=torch.float64, device=device), freqs)


class ImageEmbedder(nn.Module):
    """The image encoder's tokens into the model's width (diffusers' WanImageEmbedding): LayerNorm, GELU
    feed-forward, LayerNorm (the norms in float32); with pos_embed (Wan 2.1 FLF2V: a first and a last frame), the two
    images' tokens side by side, plus a learnt position embedding."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([nn.Module(), nn.Identity(), nn.Linear(image_dim, dim)])
        self.ff.net[0].proj = nn.Linear(image_dim, image_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.pos_embed = None if pos_embed_seq_len is None else nn.Parameter(torch.empty(1, pos_embed_seq_len,
                                                                                          image_dim))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            image = image.reshape(-1, self.pos_embed.shape[1], image.shape[-1]) + self.pos_embed
        x = float32_layer_norm(image, self.norm1)
        x = self.ff.net[2](F.gelu(self.ff.net[0].proj(x)))
        return float32_layer_norm(x, self.norm2)


def float32_layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """norm of x computed in float32, in x's type (diffusers' FP32LayerNorm)."""
    return F.layer_norm(x.float(), x.shape[-1:], norm.weight.float(), norm.bias.float(), norm.eps).type_as(x)


class ConditionEmbedder(nn.Module):
    """The timestep's embedding and the six modulations of every block, and the text's (and the image's) projection
    (diffusers' WanTimeTextImageEmbedding)."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int, image_dim: int | None = None,
                 pos_embed_seq_len: int | None = None):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = MLPEmbedder(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = MLPEmbedder(text_dim, dim, lambda x: F.gelu(x, approximate="tanh"))
        self.image_embedder = None if image_dim is None else ImageEmbedder(image_dim, dim, pos_embed_seq_len)

    def forward(self, timestep: torch.Tensor, text: torch.Tensor,
                image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(temb [B, dim], the blocks' modulations [B, 6, dim], text [B, L, dim], the image's tokens [B, I, dim] or
        None); a timestep per token [B, T] gives temb [B, T, dim] and modulations [B, T, 6, dim]."""
        frequencies = timestep_embedding(timestep.flatten(), self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(frequencies).type_as(text).unflatten(0, timestep.shape)
        modulation = self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))
        image = None if image is None else self.image_embedder(image)
        return temb, modulation, self.text_embedder(text), image


class SelfAttention(nn.Module):
    """attn1 and its residual: x plus the gated attention of x's modulated norm. q, k, v of this rank's heads and
    tokens, normalised across all heads, rotated (one kernel each: mdtriton.families.wan.qkv), attended over the
    whole sequence by the plan's method, projected back (AllReduce). With a method that exchanges heads (Ulysses),
    v, k and q are each sent as soon as they are made, in the exchange's layout, while the next is made."""

    def __init__(self, dim: int, heads: int, eps: float, comm: Communicator, attention,
                 exchange: HeadExchange | None, fp8: bool):
        super().__init__()
        self.comm, self.attention, self.exchange = comm, attention, exchange
        self.head_dim, self.eps = dim // heads, eps
        self.to_q = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.to_k = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.to_v = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.norm_q = ColumnParallelRMSNorm(dim, comm, eps)
        self.norm_k = ColumnParallelRMSNorm(dim, comm, eps)
        self.to_out = nn.ModuleList([RowParallelLinear(dim, dim, comm, fp8=fp8)])

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, valid_len: int) -> torch.Tensor:
        # Three GEMMs, not one fused q|k|v GEMM as FLUX's: its output would stay alive until the rotated q and k are
        # written beside it (0.3 GiB more peak memory at 720p on an H100, and no faster).
        normed = modulated_norm(x, shift, scale, self.eps)
        rotary = (cos, sin, self.norm_q.features, self.eps, self.head_dim)
        # The sends and the attention call stay here, not in a helper: a graph break inside a helper would split the
        # helper into a region of its own.
        if self.exchange is not None:
            ranks = self.comm.ulysses_size
            self.exchange.send("v", packed_heads(self.to_v(normed), self.head_dim, ranks))
            k = self.to_k(normed)
            (k_squares,) = sums_of_squares(self.comm, k)
            self.exchange.send("k", norm_rotate_heads(k, k_squares, self.norm_k.weight, *rotary, ranks))
            q = self.to_q(normed)
            (q_squares,) = sums_of_squares(self.comm, q)
            self.exchange.send("q", norm_rotate_heads(q, q_squares, self.norm_q.weight, *rotary, ranks))
            out = self.exchange.attention(valid_len)
        else:
            q, k, v = self.to_q(normed), self.to_k(normed), self.to_v(normed)
            q_squares, k_squares = sums_of_squares(self.comm, q, k)
            q = norm_rotate_heads(q, q_squares, self.norm_q.weight, *rotary, 1)[0]
            k = norm_rotate_heads(k, k_squares, self.norm_k.weight, *rotary, 1)[0]
            v = v.unflatten(-1, (-1, self.head_dim))
            out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.comm, valid_len)
        out = self.to_out[0](out.transpose(1, 2).flatten(2).type_as(x))
        return (x.float() + out * gate).type_as(x)


class CrossAttention(nn.Module):
    """attn2 and its residual: x plus the attention of x's norm (the block's norm2, if any) to all of the text
    (which every rank holds), by this rank's tokens and heads. With added_kv_proj_dim (Wan 2.1 I2V) the same queries
    attend the image's tokens too, with keys and values of their own, and the two attentions are summed before the
    output projection, as diffusers' WanAttnProcessor does."""

    def __init__(self, dim: int, heads: int, eps: float, comm: Communicator, fp8: bool,
                 added_kv_proj_dim: int | None = None):
        super().__init__()
        self.comm, self.local_heads = comm, heads // comm.tp_size
        self.to_q = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.to_k = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.to_v = ColumnParallelLinear(dim, dim, comm, fp8=fp8)
        self.to_kv: ColumnParallelLinear | None = None
        self.norm_q = ColumnParallelRMSNorm(dim, comm, eps)
        self.norm_k = ColumnParallelRMSNorm(dim, comm, eps)
        self.to_out = nn.ModuleList([RowParallelLinear(dim, dim, comm, fp8=fp8)])
        self.to_added_kv: ColumnParallelLinear | None = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = ColumnParallelLinear(added_kv_proj_dim, dim, comm, fp8=fp8)
            self.add_v_proj = ColumnParallelLinear(added_kv_proj_dim, dim, comm, fp8=fp8)
            self.norm_added_k = ColumnParallelRMSNorm(dim, comm, eps)

    def fuse_projections(self) -> None:
        self.to_kv = fuse_columns({"to_k": self.to_k, "to_v": self.to_v})
        del self.to_k, self.to_v
        if hasattr(self, "add_k_proj"):
            self.to_added_kv = fuse_columns({"add_k_proj": self.add_k_proj, "add_v_proj": self.add_v_proj})
            del self.add_k_proj, self.add_v_proj

    def forward(self, x: torch.Tensor, text: torch.Tensor, norm: nn.LayerNorm | None,
                image: torch.Tensor | None = None) -> torch.Tensor:
        normed = x if norm is None else F.layer_norm(x.float(), x.shape[-1:], norm.weight, norm.bias,
                                                     norm.eps).type_as(x)
        q = self.to_q(normed)
        k, v = self.to_kv(text).chunk(2, dim=-1)
        if image is None:
            q_squares, k_squares = sums_of_squares(self.comm, q, k)
        else:
            image_k, image_v = self.to_added_kv(image).chunk(2, dim=-1)
            q_squares, k_squares, image_squares = sums_of_squares(self.comm, q, k, image_k)
            image_k = self.norm_added_k(image_k, image_squares)
        q, k = self.norm_q(q, q_squares), self.norm_k(k, k_squares)
        q, k, v = (heads_first(part, self.local_heads) for part in (q, k, v))
        out = local_attention(q, k, v, self.comm, k.shape[2])  # every text token: this rank's queries over all keys
        if image is not None:
            image_k, image_v = heads_first(image_k, self.local_heads), heads_first(image_v, self.local_heads)
            out = out + local_attention(q, image_k, image_v, self.comm, image_k.shape[2]).type_as(out)
        return x + self.to_out[0](out.transpose(1, 2).flatten(2).type_as(x))


def heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, heads x head_dim] as [B, heads, L, head_dim]."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


class FeedForward(nn.Module):
    """ffn and its residual: x plus the gated feed-forward of x's modulated norm; net.0.proj (tanh GELU) by columns,
    net.2 by rows, diffusers' names."""

    def __init__(self, dim: int, ffn_dim: int, comm: Communicator, eps: float, fp8: bool):
        super().__init__()
        self.eps = eps
        self.net = nn.ModuleList([nn.Module(), nn.Identity(), RowParallelLinear(ffn_dim, dim, comm, fp8=fp8)])
        self.net[0].proj = ColumnParallelLinear(dim, ffn_dim, comm, fp8=fp8)

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = self.net[2](self.net[0].proj.forward_gelu(modulated_norm(x, shift, scale, self.eps)))
        return (x.float() + out.float() * gate).type_as(x)


class WanBlock(nn.Module):
    """diffusers' WanTransformerBlock: modulated self-attention, cross-attention to the text, modulated
    feed-forward; norms, modulations and gated residuals in float32 as diffusers computes them. Each sub-layer takes
    x and returns the new x (its norm and residual inside); Wan.forward runs them in turn (see there why)."""

    def __init__(self, config: dict, comm: Communicator, attention, exchange: HeadExchange | None, fp8: bool):
        super().__init__()
        heads, eps = config["num_attention_heads"], config["eps"]
        dim = heads * config["attention_head_dim"]
        self.attn1 = SelfAttention(dim, heads, eps, comm, attention, exchange, fp8)
        self.attn2 = CrossAttention(dim, heads, eps, comm, fp8, config["added_kv_proj_dim"])
        self.norm2 = nn.LayerNorm(dim, eps) if config["cross_attn_norm"] else None
        self.ffn = FeedForward(dim, config["ffn_dim"], comm, eps, fp8)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, dim))

    def fuse_projections(self) -> None:
        self.attn2.fuse_projections()

    def modulations(self, modulation: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift, scale, gate) of the self-attention, then of the feed-forward (float32), of modulation [B, 6, dim]
        (each [B, 1, dim]) or, a timestep per token, [B, T, 6, dim] (each [B, T, dim])."""
        if modulation.ndim == 4:
            return tuple(part.squeeze(2) for part in (self.scale_shift_table + modulation.float()).chunk(6, dim=2))
        return (self.scale_shift_table + modulation.float()).chunk(6, dim=1)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without weights, in float32 (diffusers' FP32LayerNorm)."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x's LayerNorm (float32) scaled by 1 + scale and shifted, in x's type."""
    return (layer_norm(x, eps) * (1 + scale) + shift).type_as(x)


class Wan(nn.Module):
    """One rank's Wan transformer: inputs by diffusers' names, output {"sample"} [B, out, F, H, W] in full on every
    rank. fp8: the blocks' linear layers hold e4m3 weights with row scales; the rest stays in the engine's type."""

    keep_in_float32 = ("time_embedder", "scale_shift_table", "norm1", "norm2")

    def __init__(self, config: dict, comm: Communicator, fp8: bool = False):
        super().__init__()
        check_plan(config, comm.plan)
        self.comm = comm
        self.patch_size = tuple(config["patch_size"])
        heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
        dim = heads * head_dim
        self.eps = config["eps"]
        self.out_channels = config["out_channels"] or config["in_channels"]
        self.patch_embedding = nn.Conv3d(config["in_channels"], dim, self.patch_size, self.patch_size)
        self.condition_embedder = ConditionEmbedder(dim, config["freq_dim"], config["text_dim"], config["image_dim"],
                                                    config["pos_embed_seq_len"])
        # One exchange for all blocks (they run one after another), as one attention function.
        attention, exchange = attention_for(comm.plan), head_exchange_for(comm)
        self.blocks = nn.ModuleList(WanBlock(config, comm, attention, exchange, fp8) for _ in range(config["num_layers"]))
        self.proj_out = nn.Linear(dim, self.out_channels * math.prod(self.patch_size))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))
        self.head_dim = head_dim

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Denoiser output for the latent video hidden_states [B, C, F, H, W] at timestep [B] (float; or one per token
        [B, T]), with the text encoder_hidden_states [B, L, text_dim] and, for an image-to-video model with an image
        encoder, its tokens encoder_hidden_states_image [B, I, image_dim]. Every rank gets the same full inputs and
        embeds only its tokens."""
        x, temb, modulation, text, image, cos, sin = self.embed(hidden_states, timestep, encoder_hidden_states,
                                                                encoder_hidden_states_image)
        _, tokens, _, _ = self.layout(hidden_states)
        # The sub-layers run in turn from this one frame, each compiled alone: attention and collectives run eagerly
        # between compiled regions (graph breaks), and a frame holds what it had at a break until it returns, so a
        # block compiled whole kept its input, its norms' outputs and x in float32 alive to its end (720p peak on an
        # H100: 34.5 GiB that way, 31.1 GiB this way, at the same speed); here only the current x is held (a helper
        # running the loop would hold the blocks' input too, as its caller's argument).
        for block in self.blocks:
            shift, scale, gate, c_shift, c_scale, c_gate = block.modulations(modulation)
            x = block.attn1(x, shift, scale, gate, cos, sin, tokens)
            x = block.attn2(x, text, block.norm2, image)
            x = block.ffn(x, c_shift, c_scale, c_gate)
        return self.finish(x, temb, hidden_states)

    # First Block Cache (mdtriton.engine.step_cache) runs the forward in three parts, each taking the request's inputs
    # by name and what the parts before it returned.
    def first_block(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    encoder_hidden_states_image: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The embeddings and the first block: its output (as `x` for the blocks after it, and as `hidden`, which the
        last block's output is compared with), and its `residual` (output minus input) on this rank's tokens, which
        decides whether the other blocks run."""
        x, temb, modulation, text, image, cos, sin = self.embed(hidden_states, timestep, encoder_hidden_states,
                                                                encoder_hidden_states_image)
        hidden = self.run_blocks(self.blocks[:1], x, modulation, text, image, cos, sin, hidden_states)
        _, tokens, first, end = self.layout(hidden_states)
        carried = {"hidden": hidden, "x": hidden, "residual": (hidden - x)[:, :end - first], "temb": temb,
                   "modulation": modulation, "text": text, "cos": cos, "sin": sin}
        return carried if image is None else {**carried, "image": image}

    def other_blocks(self, x: torch.Tensor, temb: torch.Tensor, modulation: torch.Tensor, text: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, hidden_states: torch.Tensor,
                     image: torch.Tensor | None = None, **_) -> dict[str, torch.Tensor]:
        """Every block after the first, then the output: forward's outputs, and "hidden", the last block's output."""
        hidden = self.run_blocks(self.blocks[1:], x, modulation, text, image, cos, sin, hidden_states)
        return {**self.finish(hidden, temb, hidden_states), "hidden": hidden}

    def finish(self, hidden: torch.Tensor, temb: torch.Tensor, hidden_states: torch.Tensor,
               **_) -> dict[str, torch.Tensor]:
        """The output {"sample"} of the last block's output `hidden` (also a step that skips the other blocks)."""
        batch, _, frames, height, width = hidden_states.shape
        grid, tokens, _, _ = self.layout(hidden_states)
        p_t, p_h, p_w = self.patch_size
        if temb.ndim == 3:  # a timestep per token
            shift, scale = (part.squeeze(2) for part in (self.scale_shift_table + temb.unsqueeze(2)).chunk(2, dim=2))
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = modulated_norm(hidden, shift, scale, self.eps)
        x = self.comm.cp_all_gather(self.proj_out(x), dim=1)[:, :tokens]
        x = x.reshape(batch, *grid, p_t, p_h, p_w, self.out_channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return {"sample": x.reshape(batch, self.out_channels, frames, height, width)}

    def layout(self, hidden_states: torch.Tensor) -> tuple[tuple[int, int, int], int, int, int]:
        """The latent video's patch grid, its token count, and this rank's tokens [first, end)."""
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        tokens = math.prod(grid)
        local_len = -(-tokens // self.comm.cp_size)
        first = min(self.comm.cp_rank * local_len, tokens)
        return grid, tokens, first, min(first + local_len, tokens)

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              encoder_hidden_states_image: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """This rank's tokens embedded (padded to the context-parallel share), temb, the blocks' modulation, the text,
        the image's tokens (or None), and the rotary cos and sin of its tokens. A timestep per token [B, T] is cut to
        this rank's tokens (and padded) before it is embedded: its modulations are those of this rank's tokens."""
        batch, channels = hidden_states.shape[:2]
        p_t, p_h, p_w = self.patch_size
        grid, tokens, first, end = self.layout(hidden_states)
        local_len = -(-tokens // self.comm.cp_size)
        # The patch embedding as a GEMM over this rank's patches (a Conv3d with stride = kernel is one).
        patches = hidden_states.reshape(batch, channels, grid[0], p_t, grid[1], p_h, grid[2], p_w)
        patches = patches.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, tokens, -1)[:, first:end]
        weight = self.patch_embedding.weight.reshape(self.patch_embedding.weight.shape[0], -1)
        x = F.pad(F.linear(patches, weight, self.patch_embedding.bias), (0, 0, 0, local_len - (end - first)))
        cos, sin = self.rotary(grid, first, end, local_len)
        if timestep.ndim == 2:
            timestep = F.pad(timestep[:, first:end], (0, local_len - (end - first)))
        temb, modulation, text, image = self.condition_embedder(timestep, encoder_hidden_states,
                                                                encoder_hidden_states_image)
        return x, temb, modulation, text, image, cos, sin

    def run_blocks(self, blocks, x: torch.Tensor, modulation: torch.Tensor, text: torch.Tensor,
                   image: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   hidden_states: torch.Tensor) -> torch.Tensor:
        """x after `blocks` (as forward runs them; First Block Cache keeps the blocks' input anyway)."""
        _, tokens, _, _ = self.layout(hidden_states)
        for block in blocks:
            shift, scale, gate, c_shift, c_scale, c_gate = block.modulations(modulation)
            x = block.attn1(x, shift, scale, gate, cos, sin, tokens)
            x = block.attn2(x, text, block.norm2, image)
            x = block.ffn(x, c_shift, c_scale, c_gate)
        return x

    def rotary(self, grid: tuple[int, int, int], first: int, end: int,
               local_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [local_len, head_dim] (float32, each pair of channels repeated) of this rank's tokens: positions
        first..end of the (frame, row, column) grid, then padding. The head's channels rotate by frame, row and
        column in three parts, as diffusers' WanRotaryPosEmbed."""
        device = self.patch_embedding.weight.device
        positions = torch.arange(first, end, device=device)
        frame, rest = positions // (grid[1] * grid[2]), positions % (grid[1] * grid[2])
        height = width = 2 * (self.head_dim // 6)
        parts = zip((self.head_dim - height - width, height, width), grid, (frame, rest // grid[2], rest % grid[2]))
        angles = torch.cat([rotary_angles(dim, size, device)[where] for dim, size, where in parts], dim=1)
        padding = (0, 0, 0, local_len - (end - first))
        return tuple(F.pad(table(angles).repeat_interleave(2, dim=1).float(), padding) for table in (torch.cos, torch.sin))

    def fuse_projections(self) -> None:
        for block in self.blocks:
            block.fuse_projections()

    def compiled_regions(self) -> list[nn.Module]:
        """Every block's sub-layers (one compiled code serves each kind); attention and collectives run eagerly in
        between."""
        return [layer for block in self.blocks for layer in (block.attn1, block.attn2, block.ffn)]
