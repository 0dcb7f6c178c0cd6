"""NVIDIA Cosmos 3's diffusion transformer (diffusers' Cosmos3OmniTransformer), video and image generation, split
across tensor-parallel ranks by heads and across context-parallel ranks by the tokens of the joint [text; vision]
sequence.

Cosmos 3 is one language model with two pathways per layer. Text tokens ("understanding") have their own
projections, norms and MLP and attend only to earlier text (causal), so they never see the vision tokens: their
keys and values are the same at every denoising step. Vision tokens ("generation": `add_*_proj`, `*_moe_gen`)
attend to all text and vision tokens. So the module runs the text pathway once (`text_keys_values`, every
context-parallel rank the whole text: a few hundred tokens) and each step runs the vision pathway only, over the
joint sequence: rank r holds its slice of [text; vision] padded to a multiple of cp_size (FLUX's JointSlice), its
text rows' keys and values taken from the text pathway's, their queries zeros and their outputs unused (on one
context-parallel rank only the vision rows ask). The attention is the plan's method (mdtriton.engine.attention:
allgather_kv, ring, ulysses), with Cosmos 3's fewer key/value heads. Parameter names equal diffusers' state-dict
keys; the language head, the text's final norm and the sound and action heads are never loaded
(Cosmos3Family.unused_weights).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import attention_for
from mdtriton.engine.comm import Communicator
from mdtriton.engine.embeddings import MLPEmbedder, timestep_embedding
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear, fuse_columns
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.cosmos3.layers import (GatedMLP, KeyValueHeads, RMSNorm, VocabParallelEmbedding, rms_norm,
                                              rotary, rotate)
from mdtriton.families.flux.transformer import JointSlice

# diffusers' Cosmos3OmniTransformer at its default config: 36 layers, hidden 4096, 32 query heads and 8 key/value
# heads of 128, MLP 12288 (Qwen3's backbone), 48 latent channels (the Wan 2.2 VAE) in 2x2 patches: 15.2 B parameters.
COSMOS3_CONFIG = {
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "base_fps": 24,
    "enable_fps_modulation": True,
    "latent_channel": 48,
    "unified_3d_mrope_reset_spatial_ids": True,
    "unified_3d_mrope_temporal_modality_margin": 15000,
    "latent_patch_size": 2,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "patch_latent_dim": 192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "timestep_scale": 0.001,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "qk_norm_for_text": True,
    "use_und_k_norm_for_gen": False,
    "rope_axes_dim": [24, 20, 20],
}
CONFIG_KEYS = tuple(COSMOS3_CONFIG)
# A Cosmos 3 of ~60 k parameters for tests: 4 query heads and 2 key/value heads of 8 (tp 2 splits both; tp 4 keeps
# a key/value head for two ranks; ulysses on 4 ranks copies them), 4 latent channels, a byte-level vocabulary.
TINY_CONFIG = {**COSMOS3_CONFIG, "head_dim": 8, "hidden_size": 32, "intermediate_size": 48, "latent_channel": 4,
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "patch_latent_dim": 16,
               "vocab_size": 264, "rope_axes_dim": [2, 1, 1]}
TIME_CHANNELS = 256  # diffusers' Timesteps(num_channels=256) before the time embedder


def check_plan(config: dict, plan: ParallelPlan) -> None:
    """Raise ValueError saying what to change if config is not a Cosmos 3 config this family serves or plan cannot
    split it."""
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"Cosmos 3 config lacks {', '.join(missing)} "
                         "(its keys are those of diffusers' Cosmos3OmniTransformer config)")
    if config["hidden_act"] not in ("silu", "relu2"):
        raise ValueError(f"hidden_act {config['hidden_act']!r}: Cosmos 3's backbones use 'silu' (Qwen3) or 'relu2' "
                         "(Nemotron)")
    if config["head_dim"] % 2 or len(config["rope_axes_dim"]) != 3:
        raise ValueError(f"head_dim {config['head_dim']} must be even and rope_axes_dim {config['rope_axes_dim']} "
                         "three sizes (time, height, width: diffusers' interleaved 3D rotary embedding)")
    if config["patch_latent_dim"] != config["latent_channel"] * config["latent_patch_size"] ** 2:
        raise ValueError(f"patch_latent_dim {config['patch_latent_dim']} is not latent_channel x latent_patch_size^2")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} does not divide by num_key_value_heads {kv_heads}")
    plan.check_heads(heads)
    group, local = heads // kv_heads, heads // plan.tp_size
    if kv_heads % plan.tp_size and group % local:
        raise ValueError(f"tp_size {plan.tp_size} gives each rank {local} of the {heads} query heads, which use "
                         f"key/value heads of two groups of {group}; choose a tp_size that divides the "
                         f"{kv_heads} key/value heads, or one that gives each rank a divisor of {group} query heads")
    for name in ("intermediate_size", "vocab_size"):
        if config[name] % plan.tp_size:
            raise ValueError(f"{name} {config[name]} does not divide by tp_size {plan.tp_size}; choose a tp_size "
                             "that divides it")


class Attention(nn.Module):
    """One layer's self_attn: the text pathway's projections (to_q, to_k, to_v, to_out, per-head norms) and the vision
    pathway's (add_q_proj, add_k_proj, add_v_proj, to_add_out, norm_added_q, norm_added_k), heads split by tensor
    parallelism. Its forward is the vision pathway's attention and residual (a compiled region); the text pathway runs
    once per text, eagerly (`text`)."""

    def __init__(self, config: dict, comm: Communicator, attention, fp8: bool):
        super().__init__()
        hidden, head_dim, heads = config["hidden_size"], config["head_dim"], config["num_attention_heads"]
        bias, eps = config["attention_bias"], config["rms_norm_eps"]
        nemotron = config["hidden_act"] == "relu2"
        self.comm, self.attention, self.head_dim = comm, attention, head_dim
        self.kv = KeyValueHeads(heads, config["num_key_value_heads"], comm)
        self.to_q = ColumnParallelLinear(hidden, heads * head_dim, comm, bias=bias, fp8=fp8)
        self.to_k = self.kv.projection(hidden, head_dim, comm, bias, fp8)
        self.to_v = self.kv.projection(hidden, head_dim, comm, bias, fp8)
        self.to_out = RowParallelLinear(heads * head_dim, hidden, comm, bias=bias, fp8=fp8)
        self.norm_q = RMSNorm(head_dim, eps, nemotron) if config["qk_norm_for_text"] else None
        self.norm_k = RMSNorm(head_dim, eps, nemotron) if config["qk_norm_for_text"] else None
        self.k_norm_und_for_gen = (RMSNorm(head_dim, eps, nemotron) if config["use_und_k_norm_for_gen"]
                                   and not config["qk_norm_for_text"] else None)
        self.add_q_proj = ColumnParallelLinear(hidden, heads * head_dim, comm, bias=bias, fp8=fp8)
        self.add_k_proj = self.kv.projection(hidden, head_dim, comm, bias, fp8)
        self.add_v_proj = self.kv.projection(hidden, head_dim, comm, bias, fp8)
        self.to_add_out = RowParallelLinear(heads * head_dim, hidden, comm, bias=bias, fp8=fp8)
        self.norm_added_q = RMSNorm(head_dim, eps, nemotron)
        self.norm_added_k = RMSNorm(head_dim, eps, nemotron)
        self.eps, self.nemotron = eps, nemotron
        self.add_qkv: ColumnParallelLinear | None = None
        self.add_qkv_sizes: list[int] = []

    def fuse_projections(self) -> None:
        """The vision pathway's query, key and value projections as one GEMM, where the key/value heads are split
        like the queries' (replicated key/value projections stay apart)."""
        if self.kv.split:
            parts = {"add_q_proj": self.add_q_proj, "add_k_proj": self.add_k_proj, "add_v_proj": self.add_v_proj}
            self.add_qkv_sizes = [layer.weight.shape[0] for layer in parts.values()]
            self.add_qkv = fuse_columns(parts)
            del self.add_q_proj, self.add_k_proj, self.add_v_proj

    def vision_qkv(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The vision pathway's queries, keys and values of normed, [1, m, heads, head_dim] (this rank's heads)."""
        if self.add_qkv is not None:
            q, k, v = self.add_qkv(normed).split(self.add_qkv_sizes, dim=-1)
        else:
            q, k, v = self.add_q_proj(normed), self.add_k_proj(normed), self.add_v_proj(normed)
        return self.heads(q), self.kv.mine(self.heads(k)), self.kv.mine(self.heads(v))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))

    def forward(self, x: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                text_k: torch.Tensor, text_v: torch.Tensor, valid_len: int) -> torch.Tensor:
        """x [1, m, hidden] (this rank's vision tokens, then its padding) plus their attention over the joint
        sequence, projected back (AllReduce); text_k, text_v [1, kv heads, t, head_dim]: the keys and values of this
        rank's text rows, which come first in its slice."""
        q, k, v = self.vision_qkv(rms_norm(x, norm_weight, self.eps, self.nemotron))
        q, k = rotate(self.norm_added_q(q), cos, sin), rotate(self.norm_added_k(k), cos, sin)
        # The rank's slice of the joint sequence, [1, tokens, heads, head_dim] as FlashAttention-3 takes it (made by
        # the compiled code, beside the rotary embedding): its text rows' keys and values, then its vision rows'. Its
        # text rows' queries are zeros, whose outputs are dropped, except where the rank holds the whole sequence:
        # there the vision rows alone ask.
        text = text_k.shape[2]
        k, v = torch.cat((text_k.transpose(1, 2), k), dim=1), torch.cat((text_v.transpose(1, 2), v), dim=1)
        if self.comm.cp_size > 1:
            q = F.pad(q, (0, 0, 0, 0, text, 0))
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.comm, valid_len)
        out = out.transpose(1, 2).flatten(2)
        return x + self.to_add_out(out[:, text:] if self.comm.cp_size > 1 else out)

    def text(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys_only: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The text pathway's attention of x [1, L, hidden] (already normed): (its output projected back, None if
        keys_only), and the keys (through k_norm_und_for_gen where the config has it) and values [1, kv heads, L,
        head_dim] that the vision tokens attend to."""
        q, k, v = self.heads(self.to_q(x)), self.kv.mine(self.heads(self.to_k(x))), self.kv.mine(self.heads(self.to_v(x)))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        k_for_vision = self.k_norm_und_for_gen(k) if self.k_norm_und_for_gen is not None else k
        k_for_vision, v_for_vision = rotate(k_for_vision, cos, sin).transpose(1, 2), v.transpose(1, 2)
        if keys_only:
            return None, k_for_vision, v_for_vision
        q, k = rotate(q, cos, sin).transpose(1, 2), rotate(k, cos, sin).transpose(1, 2)
        out = causal_attention(q, k, v_for_vision).transpose(1, 2).flatten(2)
        return self.to_out(out.type_as(x)), k_for_vision, v_for_vision


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The text's causal attention [1, heads, L, head_dim], key/value heads shared by groups of query heads; on this
    rank alone (every context-parallel rank holds the whole text), once per text."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class DecoderLayer(nn.Module):
    """diffusers' Cosmos3VLTextMoTDecoderLayer: both pathways' attention (self_attn), norms and MLPs (mlp for text,
    mlp_moe_gen for vision)."""

    def __init__(self, config: dict, comm: Communicator, attention, fp8: bool):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        nemotron = config["hidden_act"] == "relu2"
        self.self_attn = Attention(config, comm, attention, fp8)
        self.mlp = GatedMLP(config, comm, fp8)
        self.mlp_moe_gen = GatedMLP(config, comm, fp8)
        for name in ("input_layernorm", "input_layernorm_moe_gen", "post_attention_layernorm",
                     "post_attention_layernorm_moe_gen"):
            self.add_module(name, RMSNorm(hidden, eps, nemotron))

    def fuse_projections(self) -> None:
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()
        self.mlp_moe_gen.fuse_projections()

    def vision(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, text_kv: torch.Tensor,
               valid_len: int) -> torch.Tensor:
        """The vision rows x after this layer (its two compiled regions in turn); text_kv [2, 1, kv heads, t,
        head_dim]: this rank's text rows' keys and values."""
        x = self.self_attn(x, self.input_layernorm_moe_gen.weight, cos, sin, text_kv[0], text_kv[1], valid_len)
        return self.mlp_moe_gen(x, self.post_attention_layernorm_moe_gen.weight)

    def text(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The text tokens h after this layer (h itself if keys_only: the last layer's are not needed), and the keys
        and values [2, 1, kv heads, L, head_dim] the vision tokens attend to."""
        out, k, v = self.self_attn.text(self.input_layernorm(h), cos, sin, keys_only)
        if not keys_only:
            h = self.mlp(h + out, self.post_attention_layernorm.weight)
        return h, torch.stack((k, v))


class Cosmos3(nn.Module):
    """One rank's Cosmos 3 transformer. Inputs, by name (one video or image per request, as diffusers' pipeline calls
    its transformer): `input_ids` [L] (the text; or `text_keys_values`, what `text_keys_values` made of it),
    `position_ids` [3, L + N] (the joint sequence's 3D rotary positions, float32), `vision_tokens` [1, C, T, H, W]
    (the latent video), `timestep` [1] (the noisy frames' timestep, 0-1000), `noisy_frames` [T] (1.0 for a frame to
    denoise, 0.0 for a conditioning frame, which gets no timestep embedding and a zero output). Output {"sample"}
    [1, C, T, H, W], in full on every rank. fp8: both pathways' linear layers hold e4m3 weights with row scales."""

    keep_in_float32 = ("time_embedder",)

    def __init__(self, config: dict, comm: Communicator, fp8: bool = False):
        super().__init__()
        check_plan(config, comm.plan)
        self.comm, self.config = comm, dict(config)
        hidden = config["hidden_size"]
        self.patch = config["latent_patch_size"]
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden, comm)
        attention = attention_for(comm.plan)
        self.layers = nn.ModuleList(DecoderLayer(config, comm, attention, fp8)
                                    for _ in range(config["num_hidden_layers"]))
        self.norm_moe_gen = RMSNorm(hidden, config["rms_norm_eps"], config["hidden_act"] == "relu2")
        self.proj_in = nn.Linear(config["patch_latent_dim"], hidden)
        self.proj_out = nn.Linear(hidden, config["patch_latent_dim"])
        self.time_embedder = MLPEmbedder(TIME_CHANNELS, hidden)

    def forward(self, position_ids: torch.Tensor, vision_tokens: torch.Tensor, timestep: torch.Tensor,
                noisy_frames: torch.Tensor, input_ids: torch.Tensor | None = None,
                text_keys_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if text_keys_values is None:
            text_keys_values = self.text_keys_values(input_ids, position_ids)
        tokens, x, cos, sin = self.embed(position_ids, vision_tokens, timestep, noisy_frames, text_keys_values)
        x = self.run_layers(range(len(self.layers)), x, cos, sin, tokens, text_keys_values)
        return self.finish_tokens(tokens, x, vision_tokens, noisy_frames)

    def text_keys_values(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The text pathway, run once for a text: the keys and values every layer's vision tokens attend to, [layers,
        2, 1, kv heads, L, head_dim] (this tensor-parallel rank's heads; every context-parallel rank all L tokens).
        They depend on the text and its positions only (the text attends causally to itself), so a pipeline
        computes them once per request and hands them to every step (`text_keys_values` input)."""
        cos, sin = self.rotary(position_ids[:, :input_ids.shape[0]])
        h = self.embed_tokens(input_ids)[None]
        kept = []
        for index, layer in enumerate(self.layers):
            h, kv = layer.text(h, cos, sin, keys_only=index == len(self.layers) - 1)
            kept.append(kv)
        return torch.stack(kept)

    # First Block Cache (mdtriton.engine.step_cache) runs the forward in three parts, each taking the request's inputs
    # by name and what the parts before it returned.
    def first_block(self, position_ids: torch.Tensor, vision_tokens: torch.Tensor, timestep: torch.Tensor,
                    noisy_frames: torch.Tensor, input_ids: torch.Tensor | None = None,
                    text_keys_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The embeddings and the first layer: its output (as `x` for the next part and `hidden` to compare with the
        last layer's output), the `residual` it added to this rank's vision tokens, the rotary tables, and the text's
        keys and values if it made them (from input_ids)."""
        made = {}
        if text_keys_values is None:
            text_keys_values = made["text_keys_values"] = self.text_keys_values(input_ids, position_ids)
        tokens, x_in, cos, sin = self.embed(position_ids, vision_tokens, timestep, noisy_frames, text_keys_values)
        x = self.run_layers(range(1), x_in, cos, sin, tokens, text_keys_values)
        first, end = tokens.image_range()
        return {"x": x, "hidden": x, "residual": (x - x_in)[:, :end - first], "cos": cos, "sin": sin, **made}

    def other_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, text_keys_values: torch.Tensor,
                     position_ids: torch.Tensor, vision_tokens: torch.Tensor, noisy_frames: torch.Tensor,
                     **_) -> dict[str, torch.Tensor]:
        """Every layer after the first, then the output: forward's outputs, and `hidden`, the last layer's output."""
        tokens = self.joint_slice(position_ids, text_keys_values)
        x = self.run_layers(range(1, len(self.layers)), x, cos, sin, tokens, text_keys_values)
        return {**self.finish_tokens(tokens, x, vision_tokens, noisy_frames), "hidden": x}

    def finish(self, hidden: torch.Tensor, text_keys_values: torch.Tensor, position_ids: torch.Tensor,
               vision_tokens: torch.Tensor, noisy_frames: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        """The output of the last layer's output `hidden` (a step that skips the other layers)."""
        return self.finish_tokens(self.joint_slice(position_ids, text_keys_values), hidden, vision_tokens,
                                  noisy_frames)

    def joint_slice(self, position_ids: torch.Tensor, text_keys_values: torch.Tensor) -> JointSlice:
        """This rank's part of the joint [text; vision] sequence."""
        text_len = text_keys_values.shape[4]
        return JointSlice.of(text_len, position_ids.shape[1] - text_len, self.comm)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        return rotary(position_ids, config["head_dim"], config["rope_theta"], config["rope_axes_dim"],
                      self.proj_in.weight.dtype)

    def embed(self, position_ids: torch.Tensor, vision_tokens: torch.Tensor, timestep: torch.Tensor,
              noisy_frames: torch.Tensor, text_keys_values: torch.Tensor) -> tuple[JointSlice, torch.Tensor, ...]:
        """This rank's slice; its vision rows [1, m, hidden]: its vision tokens embedded (patches projected, the
        timestep's embedding added to the noisy frames' tokens), then zeros for its padding; their rotary cos and sin
        (zeros for the padding)."""
        tokens = self.joint_slice(position_ids, text_keys_values)
        first, end = tokens.image_range()
        _, channels, frames, height, width = vision_tokens.shape
        p = self.patch
        # Sides padded to whole patches (720p's 45 latent rows: 23 patches), patches in (frame, row, column) order.
        latent = F.pad(vision_tokens[0], (0, -width % p, 0, -height % p))
        rows, columns = latent.shape[2] // p, latent.shape[3] // p
        patches = latent.reshape(channels, frames, rows, p, columns, p).permute(1, 2, 4, 3, 5, 0)
        x = self.proj_in(patches.reshape(-1, p * p * channels)[first:end])
        frequencies = timestep_embedding(timestep.float() * self.config["timestep_scale"], TIME_CHANNELS)
        temb = self.time_embedder(frequencies.to(self.time_embedder.linear_1.weight.dtype)).to(x.dtype)
        noisy = noisy_frames.repeat_interleave(rows * columns)[first:end, None] > 0
        padding = (0, 0, 0, tokens.padding())
        x = F.pad(torch.where(noisy, x + temb, x), padding)[None]
        cos, sin = self.rotary(position_ids[:, tokens.text_len + first:tokens.text_len + end])
        return tokens, x, F.pad(cos, padding), F.pad(sin, padding)

    def run_layers(self, indices: range, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: JointSlice,
                   text_keys_values: torch.Tensor) -> torch.Tensor:
        """x after the layers of these indices, each layer's regions run in turn from this frame (as Wan's: a frame
        holds what it had at a graph break until it returns)."""
        first, end = tokens.text_range()
        for index in indices:
            text_kv = text_keys_values[index, ..., first:end, :]
            x = self.layers[index].vision(x, cos, sin, text_kv, tokens.valid_len)
        return x

    def finish_tokens(self, tokens: JointSlice, x: torch.Tensor, vision_tokens: torch.Tensor,
                      noisy_frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """The velocity of the whole latent video, on every rank: the final norm and projection of this rank's vision
        tokens, gathered across the context-parallel ranks (each contributes its slice of the joint sequence), then
        turned back from patches; conditioning frames are zeros, as diffusers leaves them."""
        first, end = tokens.text_range()
        out = F.pad(self.proj_out(self.norm_moe_gen(x)), (0, 0, end - first, 0))
        out = self.comm.cp_all_gather(out, dim=1)[0, tokens.text_len:tokens.valid_len]
        _, channels, frames, height, width = vision_tokens.shape
        p = self.patch
        rows, columns = -(-height // p), -(-width // p)
        out = out.reshape(frames, rows, columns, p, p, channels).permute(5, 0, 1, 3, 2, 4)
        out = out.reshape(channels, frames, rows * p, columns * p)[:, :, :height, :width]
        return {"sample": (out * (noisy_frames[None, :, None, None] > 0)).type_as(x)[None]}

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.fuse_projections()

    def compiled_regions(self) -> list[nn.Module]:
        """Each layer's vision attention and vision MLP (one compiled code serves each kind); attention and
        collectives run eagerly in between. The text pathway runs once per text, eagerly."""
        return [region for layer in self.layers for region in (layer.self_attn, layer.mlp_moe_gen)]

