"""Any other diffusers pipeline served with no code of ours ("diffusers-pipeline"): its request is read off its
`__call__` at build time, its transformer is diffusers' own, split by the transformer class's `_cp_plan` as the named
pipelines' are (mdtriton.pipeline.generic).

The build inspects the pipeline class that the directory's model_index.json names and takes, of its call's
parameters, those a request can carry as tensors (KNOWN_INPUTS: prompts, sizes, frames, steps, guidance scales, the
text length, a first and a last image); `seed` becomes its `generator`. Each is optional with the call's own default
(None: the pipeline decides, e.g. a size from its transformer's config), but the prompt, and a parameter the call
requires. A pipeline whose call requires anything else (embeddings, a mask, a video) is refused at build with the
parameter's name. A call with `num_frames` makes a video (UINT8 [batch, frames, height, width, 3]), any other an image
(UINT8 [batch, height, width, 3]). What the build read is kept in the served manifest (config["call"]), so the stubs
check requests without diffusers.

The checks are the ones every pipeline's requests share (mdtriton.pipeline.request_checks): UTF-8 prompts, the batch,
sides that are positive multiples of 8 and no larger than MAX_SIDE, a cost bound in tokens (an upper estimate for an
8x VAE with 2x2 patches and 4 frames a latent frame, as Wan, FLUX and Qwen-Image have), steps and guidance in range.
What only the pipeline knows (a multiple of 32 for LTX's VAE, a frame count it cannot take) it refuses itself when
the job starts, on every rank before any collective: the request is answered with diffusers' own message, and the
ranks serve on (mdtriton.engine.job_control).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError, Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.generic import DiffusersPipelinePart, compile_blocks
from mdtriton.pipeline.part import to_uint8
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (MAX_IMAGE_SIDE, check_batch, check_sides, check_steps_and_guidance,
                                             prompts_of)

ANY_PIPELINE = "diffusers-pipeline"
# The call parameters a request carries, by name, with their served type and shape.
KNOWN_INPUTS = {
    "prompt": ("STRING", (-1,)),
    "prompt_2": ("STRING", (-1,)),
    "negative_prompt": ("STRING", (-1,)),
    "negative_prompt_2": ("STRING", (-1,)),
    "image": ("UINT8", (-1, -1, 3)),
    "last_image": ("UINT8", (-1, -1, 3)),
    "height": ("INT32", (1,)),
    "width": ("INT32", (1,)),
    "num_frames": ("INT32", (1,)),
    "frame_rate": ("FP32", (1,)),
    "num_inference_steps": ("INT32", (1,)),
    "guidance_scale": ("FP32", (1,)),
    "guidance_scale_2": ("FP32", (1,)),
    "true_cfg_scale": ("FP32", (1,)),
    "max_sequence_length": ("INT32", (1,)),
}
GUIDANCE_INPUTS = ("guidance_scale", "guidance_scale_2", "true_cfg_scale")
# Call parameters the server sets itself (the generator from `seed`, the output, progress) or that only change how
# a request is given (precomputed embeddings, latents, timesteps), not what it is.
SET_BY_SERVER = ("generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs")
SIDE_MULTIPLE = 8  # every diffusers VAE compresses by 8 at least
MAX_SIDE = MAX_IMAGE_SIDE
MAX_FRAMES = 1025
MAX_TEXT_TOKENS = 4096


def read_call(pipeline_dir: Path) -> dict:
    """What a request to the pipeline in pipeline_dir carries, read off its class's `__call__`: {"pipeline_class",
    "inputs": {name: default or None}, "required": [names], "output": "image" or "video"}. EngineError, naming the
    class and the parameter, for a pipeline the server cannot call."""
    index_path = Path(pipeline_dir) / "model_index.json"
    if not index_path.is_file():
        raise EngineError(f"{pipeline_dir}: no model_index.json; pass a diffusers pipeline directory")
    class_name = json.loads(index_path.read_text()).get("_class_name", "")
    diffusers = importlib.import_module("diffusers")
    pipeline_class = getattr(diffusers, class_name, None)
    if not (isinstance(pipeline_class, type) and issubclass(pipeline_class, diffusers.DiffusionPipeline)):
        raise EngineError(f"{index_path}: diffusers {diffusers.__version__} has no pipeline class {class_name!r}")
    parameters = list(inspect.signature(pipeline_class.__call__).parameters.values())[1:]
    names = {parameter.name for parameter in parameters}
    if "prompt" not in names or "callback_on_step_end" not in names:
        raise EngineError(f"{class_name} cannot be served as {ANY_PIPELINE}: its call takes no "
                          f"{'prompt' if 'prompt' not in names else 'callback_on_step_end (progress and stopping)'}")
    inputs, required = {}, []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name in SET_BY_SERVER:
            continue
        needed = parameter.default is inspect.Parameter.empty
        if parameter.name not in KNOWN_INPUTS:
            if needed:
                raise EngineError(f"{class_name} cannot be served as {ANY_PIPELINE}: its call requires "
                                  f"{parameter.name!r}, which a request cannot carry (it takes "
                                  f"{', '.join(KNOWN_INPUTS)}, and seed)")
            continue
        default = None if needed or not isinstance(parameter.default, (int, float)) else parameter.default
        inputs[parameter.name] = default
        if needed or parameter.name == "prompt":
            required.append(parameter.name)
    return {"pipeline_class": class_name, "inputs": inputs, "required": required,
            "output": "video" if "num_frames" in inputs else "image",
            **step_cache_offer(pipeline_class, Path(pipeline_dir))}


def step_cache_offer(pipeline_class: type, pipeline_dir: Path) -> dict:
    """The step cache methods diffusers' cache hooks run correctly on the pipeline (mdtriton.pipeline.diffusers_cache):
    {"cache_methods": [...], "cache_contexts": the contexts its unnamed calls run under (["cond"]) or None where its
    call names them, "cache_note": why a method is not offered}. Both methods need one transformer (not Wan 2.2
    A14B's two experts) whose calls name their cache context, or one call a step; First Block Cache blocks that
    diffusers' hooks know, of one return layout and diffusers' argument names; TaylorSeer attention modules its
    default patterns name."""
    import torch
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS

    name = pipeline_class.__name__
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    if (index.get("transformer_2") or [None])[0] is not None:
        return {"cache_methods": [], "cache_contexts": None,
                "cache_note": f"{name} has a second transformer (transformer_2), and the step cache runs on the first "
                              "only: the steps of the second would be neither cached nor counted"}
    source = inspect.getsource(pipeline_class.__call__)
    contexts = None if "cache_context(" in source else ["cond"]
    if contexts is not None and source.count("self.transformer(") != 1:
        return {"cache_methods": [], "cache_contexts": None,
                "cache_note": f"{name} calls its transformer without naming a cache context, other than once a step: "
                              "diffusers' cache hooks keep one state per context"}
    config_path = pipeline_dir / "transformer" / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    transformer_class = getattr(importlib.import_module("diffusers"), config.get("_class_name", ""), None)
    if transformer_class is None:  # the build refuses it (DiffusersPipelinePart.check_build), naming what is missing
        return {"cache_methods": [], "cache_contexts": None, "cache_note": ""}
    try:
        with torch.device("meta"):  # its modules' names and classes, without weights
            transformer = transformer_class.from_config(config)
    except (RuntimeError, NotImplementedError) as error:  # a module that computes on its weights as it is made
        return {"cache_methods": [], "cache_contexts": None,
                "cache_note": f"its blocks could not be read off {transformer_class.__name__} at build ({error})"}
    methods, notes = [], []
    blocks = [block for child_name, child in transformer.named_children()
              if child_name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
              for block in child]
    TransformerBlockRegistry._register()
    layouts = {(metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index,
                metadata.hidden_states_argument_name, metadata.encoder_hidden_states_argument_name)
               if (metadata := TransformerBlockRegistry._registry.get(type(block))) else None for block in blocks}
    if len(blocks) >= 2 and len(layouts) == 1 and None not in layouts and next(iter(layouts))[2:] == (
            "hidden_states", "encoder_hidden_states"):
        methods.append("first_block")
    else:
        block_names = ", ".join(sorted({type(block).__name__ for block in blocks})) or "none"
        notes.append(f"First Block Cache: {type(transformer).__name__}'s blocks ({block_names}) are not at least two "
                     "that diffusers' block hooks know, of one return layout and its argument names")
    if any(re.fullmatch(pattern, module_name) for module_name, _ in transformer.named_modules()
           for pattern in _TRANSFORMER_BLOCK_IDENTIFIERS):
        methods.append("taylorseer")
    else:
        notes.append(f"TaylorSeer: no attention module of {type(transformer).__name__} is named as its default "
                     "patterns take")
    return {"cache_methods": methods, "cache_contexts": contexts, "cache_note": "; ".join(notes)}


class AnyPipelinePart(DiffusersPipelinePart):
    """A diffusers pipeline's request as its call reads (read_call)."""

    def __init__(self, call: dict):
        self.call = call
        self.diffusers_class = call["pipeline_class"]
        self.cache_methods = tuple(call.get("cache_methods", ()))
        self.cache_note = call.get("cache_note", "")

    @classmethod
    def of_directory(cls, pipeline_dir: Path) -> "AnyPipelinePart":
        return cls(read_call(pipeline_dir))

    def signature(self) -> Signature:
        inputs = tuple(TensorSpec(name, *KNOWN_INPUTS[name]) for name in self.call["inputs"])
        inputs += (TensorSpec("seed", "INT64", (1,)),)
        if self.call["output"] == "video":
            outputs = (TensorSpec("video", "UINT8", (-1, -1, -1, -1, 3)),)
        else:
            outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)),)
        return inputs, outputs + (TensorSpec("step", "INT32", (1,)),)

    def optional_inputs(self) -> dict[str, int | float | None]:
        optional = {name: default for name, default in self.call["inputs"].items()
                    if name not in self.call["required"]}
        return {**optional, "seed": 0}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        return {"call": self.call}

    def prepare(self, pipeline: Any, comm: Communicator, compiled: bool) -> None:
        """As every diffusers pipeline's (DiffusersPipelinePart.prepare), and a second expert (Wan 2.2 A14B's
        low-noise `transformer_2`) split across comm's context-parallel group too, and compiled with the first."""
        from mdtriton.pipeline.context_parallel import split_by_plan

        super().prepare(pipeline, comm, compiled)
        if getattr(pipeline, "transformer_2", None) is not None:
            split_by_plan(pipeline.transformer_2, comm)
            if compiled:
                compile_blocks(pipeline.transformer_2)

    def cache_contexts(self, pipeline: Any, arguments: dict) -> tuple[str, ...] | None:
        """As the build found (step_cache_offer): ("cond",) for one call a step that names no cache context."""
        contexts = self.call.get("cache_contexts")
        return tuple(contexts) if contexts is not None else None

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts (and second and negative prompts, one per prompt or none) that are not UTF-8, a batch over the
        limit, images that are not UINT8 [rows, columns, 3] of sides 1 to MAX_SIDE, sides and frames out of range, a
        request over the token limit, a text length, steps or guidance out of range."""
        prompts = prompts_of(inputs, "prompt")
        for name in ("prompt_2", "negative_prompt", "negative_prompt_2"):
            if name in inputs and len(prompts_of(inputs, name)) != len(prompts):
                raise RequestError(f"{name} has {inputs[name].shape[0]} rows, prompt {len(prompts)}; send one {name} "
                                   "per prompt, or none")
        check_batch(manifest, prompts, f"{self.call['output']}s")
        for name in ("image", "last_image"):
            if name in inputs:
                image = inputs[name]
                if image.dim() != 3 or image.shape[2] != 3 or not (1 <= min(image.shape[:2])
                                                                    and max(image.shape[:2]) <= MAX_SIDE):
                    raise RequestError(f"{name} has shape {list(image.shape)}; send UINT8 [height, width, 3] RGB "
                                       f"pixels of sides 1 to {MAX_SIDE}")
        pixels = 1
        if ("height" in inputs) != ("width" in inputs):
            raise RequestError(f"{'width' if 'height' in inputs else 'height'} missing; send both height and width, "
                               "or neither (the pipeline's own size)")
        if "height" in inputs:
            height, width = check_sides(inputs, SIDE_MULTIPLE, f"every diffusers VAE compresses by {SIDE_MULTIPLE}")
            if max(height, width) > MAX_SIDE:
                raise RequestError(f"{height}x{width} is over the largest side taken ({MAX_SIDE}); send a smaller size")
            pixels = height * width
        frames = 1
        if "num_frames" in inputs:
            frames = int(inputs["num_frames"][0])
            if not 1 <= frames <= MAX_FRAMES:
                raise RequestError(f"num_frames {frames} is out of range; send 1 to {MAX_FRAMES}")
        tokens = pixels // 256 * ((frames - 1) // 4 + 1)
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"this request is about {tokens} tokens ({pixels} pixels x {frames} frames), over this "
                               f"model's maximum of {manifest.limits.max_tokens}; send a smaller size or fewer frames "
                               "(the limit is set at build time: mdtriton build --max-tokens)")
        if "max_sequence_length" in inputs and not 1 <= int(inputs["max_sequence_length"][0]) <= MAX_TEXT_TOKENS:
            raise RequestError(f"max_sequence_length {int(inputs['max_sequence_length'][0])} is out of range; send 1 "
                               f"to {MAX_TEXT_TOKENS}")
        if "frame_rate" in inputs and not 0 < float(inputs["frame_rate"][0]) <= 1000:
            raise RequestError(f"frame_rate {float(inputs['frame_rate'][0])} is out of range; send a positive frame "
                               "rate, at most 1000")
        if "num_inference_steps" in inputs:
            check_steps_and_guidance(inputs, GUIDANCE_INPUTS, f"{self.diffusers_class}'s default: "
                                     f"{self.call['inputs'].get('guidance_scale')}")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        from PIL import Image  # the pipelines take PIL images; only the ranks, which have diffusers, call this

        arguments: dict[str, Any] = {"generator": torch.Generator().manual_seed(int(inputs["seed"][0]))}
        for name, (data_type, _) in KNOWN_INPUTS.items():
            if name not in inputs:
                continue
            value = inputs[name]
            if data_type == "STRING":
                arguments[name] = read_prompts(value, name)
            elif data_type == "UINT8":
                arguments[name] = Image.fromarray(value.cpu().numpy())
            elif data_type == "INT32":
                arguments[name] = int(value[0])
            else:
                arguments[name] = float(value[0])
        return arguments

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"image": UINT8 [batch, height, width, 3]} or {"video": UINT8 [batch, frames, height, width, 3]}, rounded
        as diffusers rounds images (in float32)."""
        if self.call["output"] == "video":
            return {"video": (result.frames.float().permute(0, 1, 3, 4, 2) * 255).round().to(torch.uint8)}
        return {"image": to_uint8(result.images)}
