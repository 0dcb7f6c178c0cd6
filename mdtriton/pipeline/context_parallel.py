"""A diffusers transformer split by sequence across the context-parallel ranks as its class declares (`_cp_plan`),
its attention run by our context-parallel methods through our Communicator: a model served on N GPUs with no model
code of ours.

diffusers declares, for each transformer class that can be split by sequence, which inputs of which submodules are
split along the sequence and which outputs are gathered (`_cp_plan`: ContextParallelInput and ContextParallelOutput
by module name; FLUX.1, FLUX.2, Qwen-Image, Wan, LTX, LTX-2 and others). diffusers' own `enable_parallelism` runs that
plan with torch's functional collectives over a DeviceMesh and its own templated ring and Ulysses attention. Here the
same plan runs with hooks of ours: each split keeps this rank's slice of the context-parallel group
(Communicator.cp_rank), each gather is the Communicator's cp_all_gather, and each attention call that the model's
processors make with the plan's config runs one of our methods (mdtriton.engine.attention: allgather_kv, ring,
ulysses, ulysses_ring) with the same code, kernels and overlap as the hand-written families, every collective through
the Communicator (its device contract, failure typing and timing).

diffusers' attention backend registry takes only the backend names of its own enum, so our attention cannot be
registered there under a name of ours. The call is routed where the processors make it instead: the
`dispatch_attention_fn` that a processor's module imported is wrapped, once per module, so that a call whose
parallel_config is a `RankAttention` runs our method, and every other call goes to diffusers' function unchanged.

A split dimension need not divide by the ranks (Qwen-Image's 1328x1328 is 6,889 image tokens): each rank takes
its share as torch.tensor_split cuts it, the first ranks one token more. A forward whose splits were all even runs
as the hand-written families do; in one that was not (every rank knows it alike: the split lengths are the same
everywhere), each attention call pads the ranks' sequences to the longest and masks the padding keys, and the
planned gathers cut the padding out again (the ranks' lengths are exchanged at the first forward of a shape, then
known: a CUDA graph of the forward holds no host sync). Masked keys (that padding, or a model's own key padding mask:
Qwen-Image's text mask for a batch of prompts of different lengths) are gathered with the keys; Ulysses then attends
the keys the mask keeps after its head exchange, and the other methods attend every key gathered, as allgather_kv
does. An attention call whose queries and keys differ in length (a cross-attention: LTX-2's text, audio to video,
video to audio) or whose mask is an additive bias attends this rank's queries over every rank's keys gathered, the
mask with them, whatever the method; a sequence the plan leaves whole (LTX-2's audio) is gathered as every rank's copy
of it, which attends as the keys once. The hooks and the attention run eagerly inside compiled blocks (graph breaks),
as our attention methods do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.context_parallel import ModuleForwardMetadata
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

from mdtriton.engine.attention import CP_ATTENTION, Attention
from mdtriton.engine.attention.local import expand_heads, plain_attention
from mdtriton.engine.attention.ulysses import exchange_heads
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.request_check import RequestError

log = logging.getLogger(__name__)

SPLIT_HOOK = "mdtriton_cp_split---{}"
GATHER_HOOK = "mdtriton_cp_gather---{}"
START_HOOK = "mdtriton_cp_start"


def context_parallel_plan(transformer_class: type) -> dict:
    """The class's context-parallel plan; EngineError naming the class if it declares none."""
    plan = getattr(transformer_class, "_cp_plan", None)
    if not plan:
        raise EngineError(f"{transformer_class.__name__} declares no context-parallel plan (diffusers' `_cp_plan`): "
                          "it runs on one GPU per model (build it with --cp 1)")
    return plan


def check_plan(transformer_class: type, config: dict, plan: ParallelPlan) -> None:
    """EngineError, before anything loads, if plan cannot split this transformer: no `_cp_plan`, tensor
    parallelism, or Ulysses over heads that do not divide by its group."""
    if plan.tp_size > 1:
        raise EngineError(f"{transformer_class.__name__} is served by diffusers' own modules, which are not split by "
                          "tensor parallelism here: build it with --tp 1 (context or guidance parallelism split it)")
    if plan.cp_size == 1:
        return
    context_parallel_plan(transformer_class)
    ulysses = plan.ulysses_size if plan.cp_method == "ulysses_ring" else plan.cp_size
    # Every stream's heads: LTX-2 has num_attention_heads for its video and audio_num_attention_heads for its audio.
    for name, heads in config.items():
        if (plan.cp_method in ("ulysses", "ulysses_ring") and name.endswith("num_attention_heads")
                and isinstance(heads, int) and heads % ulysses):
            raise EngineError(f"{transformer_class.__name__} has {heads} attention heads ({name}), which Ulysses "
                              f"cannot share among {ulysses} ranks; use --cp-method ring or allgather_kv, or a "
                              f"Ulysses group that divides {heads}")


def split_by_plan(transformer: nn.Module, comm: Communicator, plan: dict | None = None) -> None:
    """Split transformer's forward across comm's context-parallel group as plan says (diffusers' `_cp_plan` form;
    by default its class's), its attention run by comm's method. Nothing changes on one context-parallel rank."""
    if comm.cp_size == 1:
        return
    state = SplitState(comm)
    for module_name, entry in (plan or context_parallel_plan(type(transformer))).items():
        for module in submodules(transformer, module_name):
            registry = HookRegistry.check_if_exists_or_initialize(module)
            if isinstance(entry, dict):
                registry.register_hook(SplitHook(entry, state), SPLIT_HOOK.format(module_name))
            else:
                entries = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                registry.register_hook(GatherHook(entries, state), GATHER_HOOK.format(module_name))
    # Outside the plan's hooks on the transformer itself, inside any registered later (CUDA graphs, guidance): every
    # run of the forward starts afresh, a graph's warm-up and capture in one call among them.
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(StartHook(state), START_HOOK)
    attention = RankAttention(state, CP_ATTENTION[comm.plan.cp_method])
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(type(processor), "_parallel_config"):
            processor._parallel_config = attention
            route_attention(type(processor).__call__.__globals__)
    log.info("%s split by its context-parallel plan across %d ranks (%s)", type(transformer).__name__, comm.cp_size,
             comm.plan.cp_method)


def submodules(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules a plan's key names: a dotted path from model ("" is model itself), where one `*` stands for every
    module of a ModuleList."""
    found = [model]
    for atom in name.split(".") if name else []:
        if atom == "*":
            found = [child for module in found for child in module]
        else:
            found = [getattr(module, atom) for module in found]
    return found


class SplitState:
    """What the split of one forward knows, alike on every rank: whether a split was uneven (the ranks' sequences
    then differ in length by a token or a few), and the global lengths it split, in order."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.uneven = False
        self.split_lengths: list[int] = []
        self.exchanges: dict[str, int] = {}
        # Every rank's lengths, by the forward's split lengths and the exchange's place among those of its kind
        # (attention calls, gathers): the same key on every rank, so all ask for them together, once per shape.
        # Later forwards of the shape (a CUDA graph's capture among them) find them here without a host sync. By
        # kind, because a step cache may skip the later blocks' attention calls (alike on every rank: the step
        # cache's decisions are agreed): the calls it runs are the first of a whole forward's, and the gathers
        # after them the same.
        self.known_lengths: dict[tuple, list[int]] = {}
        self.known_positions: dict[tuple, torch.Tensor] = {}

    def start(self) -> None:
        """At each run of the transformer's forward (StartHook)."""
        self.uneven = False
        self.split_lengths = []
        self.exchanges = {}

    def split(self, x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """This rank's share of x along dim, as torch.tensor_split cuts it."""
        length, ranks, rank = x.shape[dim], self.comm.cp_size, self.comm.cp_rank
        if length < ranks:
            raise RequestError(f"{name} has {length} tokens along its sequence, fewer than the {ranks} "
                               "context-parallel ranks it is split among; send a larger size")
        size, extra = divmod(length, ranks)
        self.uneven = self.uneven or extra > 0
        self.split_lengths.append(length)
        return x.narrow(dim, rank * size + min(rank, extra), size + (rank < extra))

    def lengths(self, local: int, kind: str) -> list[int]:
        """Every rank's length of the sequence this rank holds `local` tokens of, in rank order, at this exchange
        (of `kind`: "attention" or "gather") of an uneven forward."""
        place = self.exchanges.get(kind, 0)
        key = (tuple(self.split_lengths), kind, place)
        self.exchanges[kind] = place + 1
        if key not in self.known_lengths:
            mine = torch.tensor([local], dtype=torch.int64, device=self.comm.device)
            self.known_lengths[key] = self.comm.cp_all_gather(mine, 0).tolist()
        return self.known_lengths[key]

    def real_positions(self, lengths: list[int]) -> torch.Tensor:
        """The positions of the real tokens in every rank's sequence padded to the longest, in rank order (made once
        per lengths, on the device)."""
        key = tuple(lengths)
        if key not in self.known_positions:
            widest = max(lengths)
            self.known_positions[key] = torch.cat([torch.arange(rank * widest, rank * widest + length)
                                                   for rank, length in enumerate(lengths)]).to(self.comm.device)
        return self.known_positions[key]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        if not self.uneven:
            return self.comm.cp_all_gather(x, dim)
        sizes = self.lengths(x.shape[dim], "gather")
        widest = max(sizes)
        gathered = self.comm.cp_all_gather(pad(x, dim, widest), dim)
        return torch.cat([gathered.narrow(dim, rank * widest, size) for rank, size in enumerate(sizes)], dim)


def pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """x with zeros after it along dim up to length."""
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


class StartHook(ModelHook):
    """Starts the split state afresh at each run of the transformer's forward."""

    def __init__(self, state: SplitState):
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        self.state.start()
        return args, kwargs


class SplitHook(ModelHook):
    """Keeps this rank's share of the module's planned inputs (or, for entries with split_output, of its outputs)."""

    def __init__(self, entries: dict, state: SplitState):
        super().__init__()
        self.entries = entries
        self.state = state
        self.metadata: ModuleForwardMetadata | None = None

    def initialize_hook(self, module):
        self.metadata = ModuleForwardMetadata(_cls=type(module))
        return module

    @torch._disable_dynamo  # the split's bookkeeping (SplitState) runs eagerly inside compiled blocks
    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        for name, entry in self.entries.items():
            if isinstance(entry, ContextParallelInput) and entry.split_output:
                continue
            value, is_kwarg, index = self.metadata._get_parameter_from_args_kwargs(name, args, kwargs)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                value = self.split(value, entry, name)
            else:
                value = [self.split(x, part, name) if isinstance(x, torch.Tensor) and not part.split_output else x
                         for x, part in zip(value, entry, strict=True)]
            if is_kwarg:
                kwargs[name] = value
            else:
                args[index] = value
        return tuple(args), kwargs

    @torch._disable_dynamo
    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        output = [output] if single else list(output)
        for index, entry in self.entries.items():
            if isinstance(entry, ContextParallelInput) and entry.split_output:
                output[index] = self.split(output[index], entry, f"output {index} of {type(module).__name__}")
        return output[0] if single else tuple(output)

    def split(self, x: torch.Tensor, entry: ContextParallelInput, name: str) -> torch.Tensor:
        if entry.expected_dims is not None and x.dim() != entry.expected_dims:
            return x  # as diffusers' plan runs: a tensor of another rank is not the one the plan splits
        return self.state.split(x, entry.split_dim, name)


class GatherHook(ModelHook):
    """Gathers the module's planned outputs from every context-parallel rank, in rank order."""

    def __init__(self, entries: list, state: SplitState):
        super().__init__()
        self.entries = entries
        self.state = state

    @torch._disable_dynamo
    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        output = [output] if single else list(output)
        for index, entry in enumerate(self.entries):
            if entry is not None:
                output[index] = self.state.gather(output[index], entry.gather_dim)
        return output[0] if single else tuple(output)


@dataclass(frozen=True)
class RankAttention:
    """The attention a split transformer's processors call (set as their parallel_config): this rank's share of
    the sequence attended over the whole context-parallel group's by `method` (an mdtriton.engine.attention
    method)."""

    state: SplitState
    method: Attention

    @torch._disable_dynamo  # eager inside compiled blocks, as our attention methods are (a graph break)
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
        """diffusers' layout in and out: [batch, local sequence, heads, head size]."""
        if dropout_p or is_causal or (scale is not None and scale != query.shape[-1] ** -0.5):
            raise NotImplementedError("context-parallel attention here is non-causal, without dropout, at the default "
                                      "scale; this model's attention asks for another")
        comm = self.state.comm
        batch, local = query.shape[:2]
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        additive = attn_mask is not None and attn_mask.dtype != torch.bool
        if additive or self.lengths_differ(local, key.shape[1]):
            return self.over_gathered_keys(q, k, v, attn_mask).transpose(1, 2)
        keep = None if attn_mask is None else key_padding(attn_mask, batch, local)
        if self.state.uneven:  # padded to the longest rank's sequence, the padding keys masked
            lengths = self.state.lengths(local, "attention")
            widest = max(lengths)
            q, k, v = (pad(x, 2, widest) for x in (q, k, v))
            if keep is None:
                real = self.state.real_positions(lengths)
                out = attention_over(q, k, v, comm, lambda keys: keys.index_select(2, real))
                return out[:, :, :local].transpose(1, 2)
            keep = pad(keep, 1, widest)
        if keep is None:
            out = self.method(q, k, v, comm, q.shape[2] * comm.cp_size)
        else:
            out = masked_attention(q, k, v, comm.cp_all_gather(keep, 1), comm)
        return out[:, :, :local].transpose(1, 2)

    def lengths_differ(self, queries: int, keys: int) -> bool:
        """Whether the queries and the keys differ in length on any rank (a cross-attention: LTX-2's text, its
        audio-video attention), alike on every rank."""
        if not self.state.uneven:  # every rank's lengths are this rank's
            return queries != keys
        return self.state.lengths(queries, "attention") != self.state.lengths(keys, "attention")

    def over_gathered_keys(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Attention [B, H, local queries, D] of this rank's queries over every rank's keys and values gathered (as
        allgather_kv attends, whatever the method), with the mask of those keys gathered with them as an additive
        bias. For queries and keys of different lengths, and masks that are biases (LTX-2's text mask). A sequence
        the plan does not split (LTX-2's audio) is gathered as every rank's copy of it: attention over copies of the
        same keys and values is attention over them once."""
        bias = None if attn_mask is None else key_bias(attn_mask, q.shape[0], k.shape[2])
        keys, values = self.state.gather(k, 2), self.state.gather(v, 2)
        if bias is not None:
            bias = self.state.gather(bias, 3).to(q.dtype)
        keys, values = expand_heads(q, keys, values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)


def attention_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, select) -> torch.Tensor:
    """Attention over the keys and values select(x) keeps of the whole sequence's ([B, H, every rank's sequence in
    rank order, D]): after Ulysses' head exchange, else over every rank's keys gathered."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return plain_attention(q, select(k), select(v))

    if comm.plan.cp_method == "ulysses":
        return exchange_heads(q, k, v, comm, attend)
    return attend(q, comm.cp_all_gather(k, 2), comm.cp_all_gather(v, 2))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     comm: Communicator) -> torch.Tensor:
    """Attention over the keys that keep [batch, whole sequence] (every rank's mask, in rank order) keeps, sample by
    sample (their counts may differ; a host sync, so not in a CUDA graph)."""
    return torch.cat([attention_over(q[b:b + 1], k[b:b + 1], v[b:b + 1], comm, lambda keys: keys[:, :, keep[b]])
                      for b in range(q.shape[0])])


def key_bias(attn_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """An additive bias [batch, 1 or heads, 1, keys] of the keys to attend, from a processor's mask of those keys
    ([batch, keys], [batch, 1, keys] or [batch, 1 or heads, 1, keys]; boolean: True keeps a key); NotImplementedError
    for a mask per query."""
    mask = attn_mask.reshape(attn_mask.shape[0], 1, 1, -1) if attn_mask.dim() < 4 else attn_mask
    if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] != length or mask.shape[0] not in (1, batch):
        raise NotImplementedError(f"an attention mask of shape {tuple(attn_mask.shape)} is not a mask of {length} keys, "
                                  "the only kind split attention here takes (a mask per query is not)")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask


def key_padding(attn_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """A boolean mask [batch, keys] of the keys to attend, from a processor's mask of those keys ([batch, keys] or
    [batch, 1, 1, keys]); NotImplementedError for masks of another kind (per query, additive)."""
    if attn_mask.dtype == torch.bool and attn_mask.dim() in (2, 4) and attn_mask.shape[-1] == length:
        mask = attn_mask.reshape(attn_mask.shape[0], -1, length)
        if mask.shape[1] == 1:
            return mask[:, 0].expand(batch, -1).contiguous()
    raise NotImplementedError(f"an attention mask of shape {tuple(attn_mask.shape)} and type {attn_mask.dtype} is "
                              "not a key padding mask, the only kind split attention here takes")


def route_attention(module_globals: dict[str, Any]) -> None:
    """Wrap the `dispatch_attention_fn` a processor's module imported, once, so that calls with a RankAttention as
    their parallel_config run it; others go to diffusers' function as before."""
    original = module_globals.get("dispatch_attention_fn")
    if original is None or getattr(original, "routes_rank_attention", False):
        return

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if isinstance(parallel_config, RankAttention):
            return parallel_config(query, key, value, attn_mask, dropout_p, is_causal, scale)
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                        backend=backend, parallel_config=parallel_config)

    dispatch_attention_fn.routes_rank_attention = True
    module_globals["dispatch_attention_fn"] = dispatch_attention_fn
