"""Family "tiny_transformer": a small stack of pre-norm transformer blocks, tensor-parallel by heads.

It exists to exercise the whole serving path (ranks, communicator, weights, Triton) with a model
small enough for CI; the FLUX transformer is the real architecture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.layers import ColumnParallelLinear, RowParallelLinear, fuse_columns
from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.family import Family, RequestSize, Signature

DEFAULT_CONFIG = {"hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, "num_layers": 2}


class TransformerBlock(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: int, comm: Communicator):
        super().__init__()
        self.local_heads = num_heads // comm.tp_size
        self.head_dim = hidden_size // num_heads
        self.norm1 = nn.LayerNorm(hidden_size)
        self.to_q = ColumnParallelLinear(hidden_size, hidden_size, comm)
        self.to_k = ColumnParallelLinear(hidden_size, hidden_size, comm)
        self.to_v = ColumnParallelLinear(hidden_size, hidden_size, comm)
        self.to_qkv = None
        self.to_out = RowParallelLinear(hidden_size, hidden_size, comm)
        self.norm2 = nn.LayerNorm(hidden_size)
        self.fc1 = ColumnParallelLinear(hidden_size, mlp_ratio * hidden_size, comm)
        self.fc2 = RowParallelLinear(mlp_ratio * hidden_size, hidden_size, comm)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

    def fuse_projections(self) -> None:
        self.to_qkv = fuse_columns({"to_q": self.to_q, "to_k": self.to_k, "to_v": self.to_v})
        del self.to_q, self.to_k, self.to_v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.to_qkv is None:
            raise RuntimeError("call fuse_projections() once the weights are loaded")
        h = self.norm1(x)
        attn = F.scaled_dot_product_attention(*(self.heads(part) for part in self.to_qkv(h).chunk(3, dim=-1)))
        x = x + self.to_out(attn.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class TinyTransformer(nn.Module):
    """Input `hidden_states` [batch, seq, hidden] -> output `output` of the same shape."""

    def __init__(self, config: dict, comm: Communicator):
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(config["hidden_size"], config["num_heads"], config["mlp_ratio"], comm)
            for _ in range(config["num_layers"])
        )
        self.norm_out = nn.LayerNorm(config["hidden_size"])

    def fuse_projections(self) -> None:
        for block in self.blocks:
            block.fuse_projections()

    def compiled_regions(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return {"output": self.norm_out(hidden_states)}


class TinyTransformerFamily(Family):
    name = "tiny_transformer"
    description = "a small stack of transformer blocks, tensor-parallel only (tests and demos)"
    module_class = TinyTransformer

    def presets(self) -> dict[str, dict]:
        return {"small": dict(DEFAULT_CONFIG)}

    def check_plan(self, config: dict, plan: ParallelPlan) -> None:
        if plan.cp_size > 1:
            raise ValueError("tiny_transformer supports tensor parallelism only (cp_size 1); use the flux "
                             "architecture for context parallelism")
        if config["num_heads"] % plan.tp_size:
            raise ValueError(f"num_heads {config['num_heads']} does not divide by tp_size {plan.tp_size}")
        if config["hidden_size"] % config["num_heads"]:
            raise ValueError(f"hidden_size {config['hidden_size']} does not divide by num_heads {config['num_heads']}")

    def signature(self, config: dict, data_type: str) -> Signature:
        hidden = config["hidden_size"]
        return ((TensorSpec("hidden_states", data_type, (-1, -1, hidden)),),
                (TensorSpec("output", data_type, (-1, -1, hidden)),))

    def request_size(self, config: dict, inputs: dict[str, torch.Tensor]) -> RequestSize:
        """Its one input is [batch, tokens, hidden]."""
        batch, tokens = inputs["hidden_states"].shape[:2]
        return RequestSize(batch, tokens)

    def warm_up_requests(self, config: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """Batch 7 first (its graphs serve every batch of 2 or more), then batch 1; prime lengths (see
        mdtriton.engine.compile)."""
        return [self.example_request(config, 1148, dtype, batch=7), self.example_request(config, 4602, dtype)]

    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return {"hidden_states": torch.randn(batch, tokens, config["hidden_size"], generator=generator).to(dtype)}


TINY_TRANSFORMER = TinyTransformerFamily()
