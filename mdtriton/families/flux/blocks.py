"""FLUX.1's double-stream and single-stream blocks on one rank: heads split across the tensor-parallel
group, tokens split across the context-parallel group (each rank holds a contiguous slice of the joint
[text; image] sequence; the attention function exchanges what the other ranks hold).

The weights load under diffusers' names (to_q, to_k, to_v, add_*_proj, proj_mlp); `fuse_projections()`,
called once they are loaded, joins q/k/v of each stream into one GEMM, and splits the single blocks' output
projection by its two inputs (attention, MLP). The forward runs only on fused blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import Attention, PackedAttention
from mdtriton.engine.comm import Communicator
from mdtriton.engine.fused_activations import attention_and_gelu_to_fp8
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear, fuse_columns
from mdtriton.families.flux.layers import AdaLayerNormZero, AdaLayerNormZeroSingle, FeedForward, joined, modulate
from mdtriton.families.flux.qkv import joint_qkv, packed_qkv

RMS_EPS = 1e-6
Rope = tuple[torch.Tensor, torch.Tensor]
# A block's modulation_linears() outputs as the context-parallel ranks' shares (layers.modulation_shares), or None
Modulation = tuple[torch.Tensor, ...] | None
NOT_FUSED = "FLUX blocks run with fused projections: call fuse_projections() once the weights are loaded"


class FluxAttention(nn.Module):
    """Column-parallel q/k/v projections with per-head RMS norms; in double blocks also the text stream's
    (add_*_proj, norm_added_*) and the row-parallel output projections of both streams."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, joint: bool, fp8: bool):
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.norm_q = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.norm_k = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.to_q = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
        self.to_k = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
        self.to_v = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
        self.to_qkv = None
        if joint:
            self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, comm, fp8=fp8)])
            self.norm_added_q = nn.RMSNorm(head_dim, eps=RMS_EPS)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=RMS_EPS)
            self.add_q_proj = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
            self.add_k_proj = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
            self.add_v_proj = ColumnParallelLinear(dim, inner, comm, fp8=fp8)
            self.to_add_out = RowParallelLinear(inner, dim, comm, fp8=fp8)
            self.add_qkv = None

    def fuse_projections(self) -> None:
        """Image (or joint) q/k/v as one layer; in double blocks the text stream's too."""
        self.to_qkv = fuse_columns({"to_q": self.to_q, "to_k": self.to_k, "to_v": self.to_v})
        del self.to_q, self.to_k, self.to_v
        if hasattr(self, "add_q_proj"):
            self.add_qkv = fuse_columns({"add_q_proj": self.add_q_proj, "add_k_proj": self.add_k_proj,
                                         "add_v_proj": self.add_v_proj})
            del self.add_q_proj, self.add_k_proj, self.add_v_proj

    def joint_qkv(self, x: torch.Tensor, text: torch.Tensor | None,
                  rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v as the [B, H, S, D] views the attention function takes: of x (the image stream of a double
        block, or a single block's joint sequence) and, in double blocks, of the text stream, whose tokens come
        first; q and k RMS-normed and rotary-embedded by rope (for the tokens in that order)."""
        q, k, v = joint_qkv(*self.projections(x, text), *rope, RMS_EPS)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def packed_qkv(self, x: torch.Tensor, text: torch.Tensor | None, rope: Rope, ranks: int) -> torch.Tensor:
        """joint_qkv's q, k and v packed as the Ulysses exchange of `ranks` ranks sends them (the packed attention's
        input: mdtriton.engine.attention.packed_attention_for)."""
        return packed_qkv(*self.projections(x, text), *rope, RMS_EPS, ranks)

    def projections(self, x: torch.Tensor, text: torch.Tensor | None) -> tuple:
        """The fused q/k/v projections of x and text (or None) and their norms' weights, as the q/k/v kernel takes
        them."""
        if self.to_qkv is None:
            raise RuntimeError(NOT_FUSED)
        text_qkv, text_q_weight, text_k_weight = (None, None, None) if text is None else (
            self.add_qkv(text), self.norm_added_q.weight, self.norm_added_k.weight)
        return self.to_qkv(x), self.norm_q.weight, self.norm_k.weight, text_qkv, text_q_weight, text_k_weight


def modulation_vectors(linears: list[nn.Linear], temb: torch.Tensor, modulation: Modulation) -> list[torch.Tensor]:
    """Each linear's output of silu(temb) [B, out_features]: joined from the ranks' shares where given, else
    computed."""
    if modulation is None:
        silu = F.silu(temb)
        return [linear(silu) for linear in linears]
    return [joined(share, linear.out_features) for share, linear in zip(modulation, linears)]


def tokens_first(out: torch.Tensor) -> torch.Tensor:
    """The attention output [B, H, S, D] as [B, S, H*D]."""
    return out.transpose(1, 2).flatten(2)


class FluxTransformerBlock(nn.Module):
    """Double-stream block: text and image keep their own weights and meet in one joint attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, attention: Attention,
                 packed_attention: PackedAttention | None, fp8: bool):
        super().__init__()
        self.comm = comm
        self.attention, self.packed_attention = attention, packed_attention
        self.fp8 = fp8
        self.norm1 = AdaLayerNormZero(dim, fp8)
        self.norm1_context = AdaLayerNormZero(dim, fp8)
        self.attn = FluxAttention(dim, heads, head_dim, comm, joint=True, fp8=fp8)
        self.ff = FeedForward(dim, comm, fp8)
        self.ff_context = FeedForward(dim, comm, fp8)

    def fuse_projections(self) -> None:
        self.attn.fuse_projections()

    def modulation_linears(self) -> list[nn.Linear]:
        """The linears whose outputs of silu(temb) the block takes as its modulation, in its order."""
        return [self.norm1.linear, self.norm1_context.linear]

    def forward(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope: Rope, valid_len: int,
                modulation: Modulation = None, attention: tuple[torch.Tensor, torch.Tensor] | None = None,
                keep_attention: bool = False):
        """image [B, S_img_local, dim] and text [B, S_txt_local, dim] -> both updated; text comes first in the
        joint sequence, so this rank's text tokens (if any) precede its image tokens. modulation: the shares of its
        modulation_linears()' outputs of silu(temb) where the context-parallel ranks computed them together
        (Flux.modulations); None: computed here.

        TaylorSeer (mdtriton.engine.step_cache): `attention`, the attention's outputs (image's and text's, after their
        output projections: what diffusers' FluxAttention returns) given instead of computed; keep_attention returns
        them too, as (image, text, (image_attention, text_attention))."""
        image_emb, text_emb = modulation_vectors(self.modulation_linears(), temb, modulation)
        norm_image, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(image, image_emb)
        norm_text, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(text, text_emb)
        if attention is None:
            # The attention function is called here, not in a helper: compiled, the graph breaks at that call, and a
            # break inside a helper would split the helper into a region of its own. Ulysses gets q, k and v packed
            # where its exchange sends them from.
            if self.packed_attention is not None:
                send = self.attn.packed_qkv(norm_image, norm_text, rope, self.comm.ulysses_size)
                joint = tokens_first(self.packed_attention(send, self.comm, valid_len))
            else:
                q, k, v = self.attn.joint_qkv(norm_image, norm_text, rope)
                joint = tokens_first(self.attention(q, k, v, self.comm, valid_len))
            # Contiguous halves: linear fuses its bias into the GEMM only for contiguous input (and would copy anyway).
            text_attn, image_attn = (part.contiguous() for part in joint.split((text.shape[1], image.shape[1]), dim=1))
            image_attn, text_attn = self.attn.to_out[0](image_attn), self.attn.to_add_out(text_attn)
        else:
            image_attn, text_attn = attention

        image = image + gate[:, None] * image_attn
        image = image + gate_mlp[:, None] * self.ff(modulate(image, shift_mlp, scale_mlp, self.fp8))
        text = text + c_gate[:, None] * text_attn
        text = text + c_gate_mlp[:, None] * self.ff_context(modulate(text, c_shift_mlp, c_scale_mlp, self.fp8))
        if text.dtype == torch.float16:
            text = text.clip(-65504, 65504)
        if keep_attention:
            return image, text, (image_attn, text_attn)
        return image, text


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block over the joint sequence: attention and MLP in parallel, one output projection
    over [attention | MLP] (row-parallel per part, so each rank's share of both lines up)."""

    def __init__(self, dim: int, heads: int, head_dim: int, comm: Communicator, attention: Attention,
                 packed_attention: PackedAttention | None, fp8: bool):
        super().__init__()
        self.comm = comm
        self.attention, self.packed_attention = attention, packed_attention
        mlp_hidden = 4 * dim
        self.fp8 = fp8
        self.norm = AdaLayerNormZeroSingle(dim, fp8)
        self.proj_mlp = ColumnParallelLinear(dim, mlp_hidden, comm, fp8=fp8)
        self.proj_out = RowParallelLinear(heads * head_dim + mlp_hidden, dim, comm,
                                          in_segments=[heads * head_dim, mlp_hidden], fp8=fp8)
        self.attn = FluxAttention(dim, heads, head_dim, comm, joint=False, fp8=fp8)

    def fuse_projections(self) -> None:
        """q, k and v as one GEMM. The MLP's first layer, which reads the same input, stays a GEMM of its own:
        so it can apply the GELU in its epilogue (on GPUs), which was measured faster than one GEMM for all four
        and a GELU pass over its MLP part (docs/benchmarks.md). In bf16 the output projection, over
        [attention | MLP], becomes one GEMM per part, so the two are never concatenated; in FP8 it stays one GEMM,
        whose quantized input the attention output and the GELU are written into together."""
        self.attn.fuse_projections()
        if not self.fp8:
            self.proj_out.split_segments()

    def mlp(self, norm_x: torch.Tensor) -> torch.Tensor:
        """The block's MLP, which does not depend on its attention: in bf16 the MLP's first layer (GELU in its
        epilogue) and the output projection's MLP part, bias included (the attention part is added into it); in FP8
        the first layer alone (its GELU is applied as it is quantized together with the attention output)."""
        return self.mlp_out(self.mlp_in(norm_x))

    def mlp_in(self, norm_x: torch.Tensor) -> torch.Tensor:
        """mlp's first layer: in bf16 with its GELU."""
        return self.proj_mlp(norm_x) if self.fp8 else self.proj_mlp.forward_gelu(norm_x)

    def mlp_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rest of mlp, of mlp_in's output."""
        return hidden if self.fp8 else self.proj_out.segment_product(1, hidden)

    def modulation_linears(self) -> list[nn.Linear]:
        """The linear whose output of silu(temb) the block takes as its modulation."""
        return [self.norm.linear]

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: Rope, valid_len: int, modulation: Modulation = None,
                attention: torch.Tensor | None = None, keep_attention: bool = False):
        """x [B, S_local, dim] -> updated x; modulation as FluxTransformerBlock's. TaylorSeer: `attention`, the
        attention's output (before the output projection: what diffusers' FluxAttention returns here) given instead of
        computed; keep_attention returns it too, as (x, attention)."""
        (emb,) = modulation_vectors(self.modulation_linears(), temb, modulation)
        norm_x, gate = self.norm(x, emb)
        if attention is None:
            # The MLP runs beside the attention: on the GPU while the attention's first transfer is in flight; with
            # Ulysses its first layer then, and the rest while the attention's output travels back.
            if self.packed_attention is not None:
                send = self.attn.packed_qkv(norm_x, None, rope, self.comm.ulysses_size)
                attn, mlp = self.packed_attention(send, self.comm, valid_len, beside=lambda: self.mlp_in(norm_x),
                                                  after=self.mlp_out)
            else:
                q, k, v = self.attn.joint_qkv(norm_x, None, rope)
                attn, mlp = self.attention(q, k, v, self.comm, valid_len, beside=lambda: self.mlp(norm_x))
            attn = tokens_first(attn)
        else:
            attn, mlp = attention, self.mlp(norm_x)
        if self.fp8:
            out = self.proj_out(attention_and_gelu_to_fp8(attn, mlp))
        else:
            out = self.comm.tp_all_reduce(self.proj_out.segment_product(0, attn, accumulate=mlp))
        x = x + gate[:, None] * out
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        if keep_attention:
            return x, attn
        return x
