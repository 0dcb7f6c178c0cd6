"""The FLUX pipeline engine: prompt to image on every rank, the transformer split across the ranks.

diffusers' own `FluxPipeline` runs the pipeline (tokenizers, CLIP and T5 encoders, the initial noise from a
CPU generator seeded with `seed`, the FlowMatchEulerDiscreteScheduler loop with FLUX's resolution-dependent
shift, the VAE), so an image equals diffusers' for the same components; its `transformer` is our multi-rank
engine behind FluxTransformer2DModel's call. Every rank runs the whole pipeline on the same inputs: the
encoders and the VAE are replicated (deterministic, so the ranks agree without sending anything), and the
transformer's collectives keep the ranks in step.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.utils import logging as diffusers_logging
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
from transformers.utils import logging as transformers_logging

from mdtriton.engine.comm import Communicator
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.engine import Engine, TorchEngine
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.pipeline.progress import report_progress
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.signature import ARCHITECTURE, MAX_SEQUENCE_LENGTH, TRANSFORMER_DIR


class EngineTransformer(torch.nn.Module):
    """FluxPipeline's `transformer`: a transformer engine called as FluxTransformer2DModel is."""

    def __init__(self, engine: TorchEngine):
        super().__init__()
        self.engine = engine
        config = engine.manifest.config
        self.config = SimpleNamespace(in_channels=config["in_channels"], guidance_embeds=config["guidance_embeds"])
        self._dtype = TORCH_DTYPES[engine.manifest.data_type]

    @property
    def device(self) -> torch.device:
        return self.engine.comm.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def cache_context(self, name: str):
        """FluxPipeline names each transformer call's cache context; the engine keeps no cache."""
        return nullcontext()

    def forward(self, hidden_states, timestep, guidance, pooled_projections, encoder_hidden_states, txt_ids, img_ids,
                joint_attention_kwargs=None, return_dict=False):
        inputs = {
            "hidden_states": hidden_states.to(self._dtype),
            "encoder_hidden_states": encoder_hidden_states.to(self._dtype),
            "pooled_projections": pooled_projections.to(self._dtype),
            "timestep": timestep.to(self._dtype),
            "img_ids": img_ids.float(),
            "txt_ids": txt_ids.float(),
        }
        if self.config.guidance_embeds:
            inputs["guidance"] = guidance.to(self._dtype)
        return (self.engine.forward(inputs)["sample"],)


class FluxPipelineEngine(Engine):
    """One rank's FLUX pipeline: the replicated encoders, scheduler and VAE, and its shard of the transformer."""

    def __init__(self, manifest: Manifest, pipeline: FluxPipeline, warm_up_seconds: float):
        self.manifest = manifest
        self.pipeline = pipeline
        self.warm_up_seconds = warm_up_seconds

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, comm: Communicator) -> "FluxPipelineEngine":
        """Load this rank's transformer shard and the pipeline's other components from engine_dir (no download);
        manifest: engine_dir's, read by the caller (the transformer's own manifest is read here)."""
        # Prompts are user data: diffusers' and transformers' truncation warnings would quote them in the server log.
        diffusers_logging.set_verbosity_error()
        transformers_logging.set_verbosity_error()
        engine_dir = Path(engine_dir)
        if manifest.architecture != ARCHITECTURE:
            raise EngineError(f"{engine_dir}: a {manifest.architecture!r} engine, not a {ARCHITECTURE!r} one")
        dtype = TORCH_DTYPES[manifest.data_type]
        try:
            components = {
                "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(engine_dir / "scheduler",
                                                                             local_files_only=True),
                "vae": AutoencoderKL.from_pretrained(engine_dir / "vae", dtype=dtype, local_files_only=True),
                "text_encoder": CLIPTextModel.from_pretrained(engine_dir / "text_encoder", dtype=dtype,
                                                              local_files_only=True),
                "tokenizer": CLIPTokenizer.from_pretrained(engine_dir / "tokenizer", local_files_only=True),
                "text_encoder_2": T5EncoderModel.from_pretrained(engine_dir / "text_encoder_2", dtype=dtype,
                                                                 local_files_only=True),
                "tokenizer_2": T5TokenizerFast.from_pretrained(engine_dir / "tokenizer_2", local_files_only=True),
            }
        except (OSError, ValueError) as error:
            raise EngineError(f"{engine_dir}: the pipeline's components do not load: {error}") from error
        for name in ("text_encoder", "text_encoder_2", "vae"):
            components[name].to(comm.device)
        # The transformer last: its load checks that its shard fits the memory the other components left free.
        transformer_dir = engine_dir / TRANSFORMER_DIR
        engine = TorchEngine.load(transformer_dir, Manifest.read(transformer_dir), comm)
        # FluxPipeline.from_pretrained would refuse a transformer that is not a diffusers model: built by hand.
        pipeline = FluxPipeline(transformer=EngineTransformer(engine), **components)
        pipeline.set_progress_bar_config(disable=True)  # the server reports progress
        return cls(manifest, pipeline, engine.warm_up_seconds)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]} for the request's inputs (mdtriton.pipeline.signature)."""
        prompt_2 = read_prompts(inputs["prompt_2"], "prompt_2") if "prompt_2" in inputs else None
        text_tokens = int(inputs["max_sequence_length"][0]) if "max_sequence_length" in inputs else MAX_SEQUENCE_LENGTH
        images = self.pipeline(
            prompt=read_prompts(inputs["prompt"], "prompt"), prompt_2=prompt_2,
            height=int(inputs["height"][0]), width=int(inputs["width"][0]),
            num_inference_steps=int(inputs["num_inference_steps"][0]),
            guidance_scale=float(inputs["guidance_scale"][0]),
            generator=torch.Generator().manual_seed(int(inputs["seed"][0])),
            max_sequence_length=text_tokens, output_type="pt", callback_on_step_end=step_done,
        ).images
        return {"image": to_uint8(images)}


def step_done(pipeline: FluxPipeline, step: int, timestep, callback_kwargs: dict) -> dict:
    """FluxPipeline's step-end callback: report the step, change nothing."""
    report_progress(step + 1, pipeline.num_timesteps)
    return callback_kwargs


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] -> UINT8 [B, H, W, 3], rounded as diffusers' numpy_to_pil (in float32)."""
    return (images.float().permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu()
