"""The pipelines the pipeline benchmarks (benchmarks/) build and serve, and the arguments they share.

A pipeline here is a diffusers directory whose transformer/ holds only its config, what `mdtriton build --architecture
NAME-pipeline --weights DIR` builds with random transformer weights (mdtriton.harness.build_pipeline): FLUX.1-dev's
components (T5-XXL, CLIP-L, the 16-channel VAE), Wan 2.1 T2V 14B's (UMT5-XXL, the Wan VAE) or Cosmos 3's (the Wan 2.2
VAE; its text runs inside the transformer) with random weights made on the GPU, or the tests' tiny pipelines (--tiny,
on the CPU). Qwen-Image's (served with diffusers' own transformer, which the build copies with the directory) holds
its transformer's random weights too, with Qwen2.5-VL 7B's text encoder and Qwen-Image's VAE (the other pipelines served
so: mdtriton.testing.random_diffusers_pipelines). The tokenizers are small local ones: token ids do not change the work
(T5 always gets max_sequence_length tokens, CLIP 77; Cosmos 3's byte-level tokenizer gives a text of as many tokens as
its bytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

from mdtriton.pipeline.fit import MODEL_INDEX
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.cosmos3 import COSMOS3
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG
from mdtriton.families.wan import WAN
from mdtriton.testing.tiny_cosmos3_pipeline import byte_tokenizer, tiny_cosmos3_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import qwen_image_scheduler, qwen_tokenizer, tiny_qwen_image_parts
from mdtriton.testing.tiny_flux_pipeline import clip_tokenizer, t5_tokenizer, tiny_flux_pipeline
from mdtriton.testing.tiny_wan_pipeline import tiny_wan_pipeline

FLUX_PROMPT = "a photo of a cat holding a sign that says hello world"
WAN_PROMPT = "a cat walking on a sunny beach, cinematic"
KONTEXT_PROMPT = "make the cat wear a red hat"
# Each architecture's prompt and guidance scale, as the pipeline benchmarks ask for its images or clips (ours and xDiT's).
# Qwen-Image's and Qwen-Image-Edit-Plus's is their true_cfg_scale; FLUX.2 [klein] 4B is guidance distilled (its model
# card's 1.0).
REQUESTS = {"flux": (FLUX_PROMPT, 3.5), "kontext": (KONTEXT_PROMPT, 2.5), "wan": (WAN_PROMPT, 5.0),
            "cosmos3": (WAN_PROMPT, 5.0), "qwen-image": (FLUX_PROMPT, 4.0),
            "qwen-image-edit-plus": (KONTEXT_PROMPT, 4.0), "flux2": (FLUX_PROMPT, 4.0),
            "flux2-klein": (FLUX_PROMPT, 1.0), "ltx2": (WAN_PROMPT, 3.0)}
# The published size whose configs each architecture's random pipeline has, for tables' titles.
MODEL_SIZES = {"flux": "FLUX.1-dev size", "kontext": "FLUX.1 Kontext [dev] size", "wan": "Wan 2.1 T2V 14B size",
               "cosmos3": "Cosmos 3 15B size", "qwen-image": "Qwen-Image 20B size",
               "qwen-image-edit-plus": "Qwen-Image-Edit-2509 20B size", "flux2": "FLUX.2 [dev] 32B size",
               "flux2-klein": "FLUX.2 [klein] 4B size", "ltx2": "LTX-2 19B size"}
# Architectures whose pipelines make images (the others make clips).
IMAGE_ARCHITECTURES = ("flux", "kontext", "qwen-image", "qwen-image-edit-plus", "flux2", "flux2-klein")
# Each video architecture's clip by default (height, width, frames): Wan's and Cosmos 3's at 720p, LTX-2's at
# LTX2Pipeline's default size; tiny: a few tokens (LTX-2's sides are multiples of 32).
CLIP_SIZES = {"wan": (720, 1280, 81), "cosmos3": (720, 1280, 189), "ltx2": (512, 768, 121)}
TINY_CLIP_SIZES = {"wan": (32, 48, 9), "cosmos3": (32, 48, 9), "ltx2": (32, 64, 9)}
# Qwen/Qwen-Image's transformer/config.json.
QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                              num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                              axes_dims_rope=(16, 56, 56))
# Qwen-Image's text encoder: Qwen2.5-VL 7B Instruct's config (its text model and vision tower).
QWEN2_5_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                          max_position_embeddings=128000,
                          rope_parameters=dict(rope_type="default", mrope_section=[16, 24, 24], rope_theta=1e6))
QWEN2_5_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2, in_chans=3, hidden_act="silu")
# Qwen-Image's VAE (vae/config.json), its latent statistics left at 0 and 1 (random weights: they do not change the
# work).
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0, latents_mean=[0.0] * 16,
                      latents_std=[1.0] * 16)
# FLUX.1-dev's components (their config.json files), T5 = google/t5-v1_1-xxl's encoder, CLIP = ViT-L/14's text model.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=2)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
FLUX_DEV_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                          max_image_seq_len=4096)
FLUX_INDEX = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
# FLUX.1 Kontext [dev]: FLUX.1-dev's components in FluxKontextPipeline, without its optional IP-Adapter encoder.
KONTEXT_INDEX = {**FLUX_INDEX, "_class_name": "FluxKontextPipeline", "image_encoder": [None, None],
                 "feature_extractor": [None, None]}
# Wan 2.1's text encoder: google/umt5-xxl's encoder (its config.json).
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
# model_index.json of a Wan 2.1 text-to-video pipeline (one transformer); the components' entries are added.
WAN_INDEX = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": False}
# Cosmos 3's VAE: Wan 2.2's (Wan-AI/Wan2.2-TI2V-5B-Diffusers' vae/config.json), its latent statistics left at 0 and 1
# (random weights: they do not change the work).
COSMOS3_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                   patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                   latents_std=[1.0] * 48)
# model_index.json of a Cosmos3OmniPipeline without sound or safety checker; the components' entries are added.
COSMOS3_INDEX = {"_class_name": "Cosmos3OmniPipeline", "transformer": ["diffusers", "Cosmos3OmniTransformer"],
                 "default_use_system_prompt": True, "enable_safety_checker": False, "safety_checker": [None, None],
                 "sound_tokenizer": [None, None], "use_native_flow_schedule": False}


def add_pipeline_arguments(parser: argparse.ArgumentParser, tiny_steps: int, disk_gb: int) -> None:
    """--tiny, --height, --width, --steps and --workdir, as every FLUX pipeline benchmark takes them (pipeline_device
    fills in their defaults). disk_gb: what --workdir needs at FLUX.1-dev size."""
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, float32 (checks the script)")
    parser.add_argument("--height", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--width", type=int, help="pixels (default 1024; --tiny: 64)")
    parser.add_argument("--steps", type=int, help=f"denoising steps (default 28; --tiny: {tiny_steps})")
    parser.add_argument("--workdir", type=Path, help="the pipeline directory and model repositories (default: a "
                                                     "temporary directory; FLUX.1-dev size needs "
                                                     f"{disk_gb} GB of disk)")


def fill_clip_sizes(args: argparse.Namespace) -> None:
    """A clip's sizes where not given (--architecture wan, cosmos3 or ltx2: CLIP_SIZES, 4 steps; tiny:
    TINY_CLIP_SIZES, 3 steps)."""
    if args.architecture not in IMAGE_ARCHITECTURES:
        height, width, frames = (TINY_CLIP_SIZES if args.tiny else CLIP_SIZES)[args.architecture]
        args.height, args.width, args.frames = args.height or height, args.width or width, args.frames or frames
        args.steps = args.steps or (3 if args.tiny else 4)


def pipeline_device(args: argparse.Namespace, tiny_steps: int) -> torch.device:
    """The device a FLUX pipeline benchmark runs on (GPU 0, or the CPU with --tiny), its size and steps filled in."""
    args.height = args.height or (64 if args.tiny else 1024)
    args.width = args.width or (64 if args.tiny else 1024)
    args.steps = args.steps or (tiny_steps if args.tiny else 28)
    return torch.device("cpu" if args.tiny else "cuda:0")


@contextmanager
def work_directory(args: argparse.Namespace) -> Iterator[Path]:
    """--workdir, or a temporary directory removed on leaving."""
    with tempfile.TemporaryDirectory(prefix="mdtriton-bench-") as scratch:
        yield args.workdir or Path(scratch)


def plan_of(name: str) -> ParallelPlan:
    """A plan by its benchmark name: '1', or parts joined by x ('tp4', 'ulysses4', 'ring4', 'allgather_kv4',
    'ulysses_ring4', 'cfg2xulysses2', 'tp2xring2')."""
    if name == "1":
        return ParallelPlan()
    sizes = {}  # "tp", "cfg", "cp" -> (method, size)
    for part in name.split("x"):
        match = re.fullmatch(r"(tp|cfg|ulysses_ring|ulysses|ring|allgather_kv)(\d+)", part)
        dimension = match.group(1) if match and match.group(1) in ("tp", "cfg") else "cp"
        if not match or dimension in sizes:
            raise SystemExit(f"unknown plan {name!r}: 1, or parts joined by x (tpN, cfgN and one of ulyssesN, ringN, "
                             "allgather_kvN, ulysses_ringN), e.g. cfg2xulysses2")
        sizes[dimension] = (match.group(1), int(match.group(2)))
    method, cp_size = sizes.get("cp", ("allgather_kv", 1))
    return ParallelPlan(tp_size=sizes.get("tp", ("tp", 1))[1], cp_size=cp_size, cp_method=method,
                        cfg_size=sizes.get("cfg", ("cfg", 1))[1], ulysses_size=2 if method == "ulysses_ring" else 1)


def save_pipeline_dir(directory: Path, index: dict, components: dict, transformer_config: dict) -> Path:
    """A diffusers pipeline directory of components (each saved by its save_pretrained, then dropped from
    `components`, and the GPU memory they held given back), whose transformer/ holds only its config. index:
    model_index.json's own entries (the pipeline's _class_name, the transformer's [library, class] and any other); the
    components' entries are added."""
    index = dict(index)
    transformer_saved = "transformer" in components  # it writes its own config with its weights
    if transformer_saved:
        index.pop("transformer", None)
    for name, component in components.items():
        component.save_pretrained(directory / name)
        index[name] = [type(component).__module__.split(".")[0], type(component).__name__]
    components.clear()
    free_memory()
    (directory / "transformer").mkdir(parents=True, exist_ok=True)
    if not transformer_saved:
        (directory / "transformer" / "config.json").write_text(json.dumps({"_class_name": index["transformer"][1],
                                                                           **transformer_config}))
    (directory / MODEL_INDEX).write_text(json.dumps(index))
    return directory


def flow_scheduler() -> UniPCMultistepScheduler:
    """UniPC's flow-matching scheduler, as Wan's and Cosmos 3's pipelines use it."""
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def flux_pipeline_dir(directory: Path, tiny: bool, device: torch.device,
                      index: dict = FLUX_INDEX) -> tuple[Path, dict]:
    """A FLUX pipeline directory (FLUX.1-dev's components, made on device in bf16; or the tests' tiny ones) and its
    transformer's config; index: model_index.json's own entries (FLUX.1 Kontext's: KONTEXT_INDEX)."""
    if tiny:
        pipeline = tiny_flux_pipeline()
        components = {name: getattr(pipeline, name) for name in ("text_encoder", "text_encoder_2", "vae", "tokenizer",
                                                                 "tokenizer_2")}
        config = {key: pipeline.transformer.config[key] for key in FLUX_DEV_CONFIG}
    else:
        with torch.device(device):
            components = {"text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP_L)).to(torch.bfloat16),
                          "text_encoder_2": T5EncoderModel(T5Config(**T5_XXL)).to(torch.bfloat16),
                          "vae": AutoencoderKL(**FLUX_VAE).to(torch.bfloat16)}
        components.update(tokenizer=clip_tokenizer(), tokenizer_2=t5_tokenizer())
        config = dict(FLUX_DEV_CONFIG)
    components["scheduler"] = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER)
    return save_pipeline_dir(directory, index, components, config), config


def kontext_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A FLUX.1 Kontext [dev] pipeline directory: FLUX.1-dev's components (Kontext's transformer is FLUX.1-dev's
    size) in FluxKontextPipeline."""
    return flux_pipeline_dir(directory, tiny, device, KONTEXT_INDEX)


def wan_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A Wan 2.1 text-to-video pipeline directory (Wan 2.1 T2V 14B's components: random UMT5-XXL made on device in
    bf16 and the Wan VAE in float32, as WanPipeline keeps it, the 480p scheduler; or the tests' tiny ones) and its
    transformer's config."""
    if tiny:
        pipeline = tiny_wan_pipeline()
        components = {name: getattr(pipeline, name) for name in ("text_encoder", "vae", "tokenizer", "scheduler")}
        config = {**dict(pipeline.transformer.config), "patch_size": list(pipeline.transformer.config.patch_size)}
        config = {key: config[key] for key in WAN.default_config()}
    else:
        with torch.device(device):
            components = {"text_encoder": UMT5EncoderModel(UMT5Config(**UMT5_XXL)).to(torch.bfloat16),
                          "vae": AutoencoderKLWan()}  # diffusers' default config: Wan 2.1's
        components.update(tokenizer=t5_tokenizer(), scheduler=flow_scheduler())
        config = WAN.presets()["wan2.1-t2v-14b"]
    return save_pipeline_dir(directory, WAN_INDEX, components, config), config


def cosmos3_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A Cosmos 3 pipeline directory (the published size's components: the Wan 2.2 VAE made on device in float32, a
    local byte-level tokenizer, UniPC's flow scheduler; or the tests' tiny ones) and its transformer's config."""
    if tiny:
        pipeline = tiny_cosmos3_pipeline()
        components = {name: getattr(pipeline, name) for name in ("text_tokenizer", "vae", "scheduler")}
        config = COSMOS3.presets()["tiny"]
    else:
        with torch.device(device):
            components = {"vae": AutoencoderKLWan(**COSMOS3_VAE)}
        components.update(text_tokenizer=byte_tokenizer(), scheduler=flow_scheduler())
        config = COSMOS3.presets()["cosmos3-15b"]
    return save_pipeline_dir(directory, COSMOS3_INDEX, components, config), config


def in_bf16(make: Callable[[], torch.nn.Module], device: torch.device) -> Callable[[], torch.nn.Module]:
    """make, run with bf16 the default data type and device the default device: a model made directly in bf16 on the
    GPU (made in float32 first, Qwen-Image's 20B transformer would not fit beside the rest)."""
    def made() -> torch.nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                return make()
        finally:
            torch.set_default_dtype(previous)

    return made


def save_made_components(directory: Path, pipeline_class: str, makers: dict[str, Callable[[], object]],
                         index: dict | None = None) -> Path:
    """A diffusers directory of pipeline_class: each component made by its maker in turn (the random draws from seed
    0), saved by its save_pretrained and dropped (its GPU memory given back) before the next is made, so that the
    largest pipelines need not fit on the GPU whole; index: model_index.json's further entries. Returns directory."""
    index = {"_class_name": pipeline_class, **(index or {})}
    torch.manual_seed(0)
    for name, make in makers.items():
        component = make()
        component.save_pretrained(directory / name)
        index[name] = [type(component).__module__.split(".")[0], type(component).__name__]
        del component
        free_memory()
    (directory / MODEL_INDEX).write_text(json.dumps(index))
    return directory


def qwen_image_makers(device: torch.device) -> dict[str, Callable[[], object]]:
    """Qwen-Image's components at the published configs, each by the call that makes it: the 20B transformer,
    Qwen2.5-VL 7B and the VAE on device in bf16, a local byte-level tokenizer with Qwen's special tokens, Qwen-Image's
    scheduler."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer()
    image_pad, video_pad, vision_start, vision_end = tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    text_config = dict(QWEN2_5_VL_7B_TEXT, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    encoder_config = Qwen2_5_VLConfig(text_config=text_config, vision_config=QWEN2_5_VL_7B_VISION,
                                      image_token_id=image_pad, video_token_id=video_pad,
                                      vision_start_token_id=vision_start, vision_end_token_id=vision_end)
    return {"transformer": in_bf16(lambda: QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER), device),
            "text_encoder": in_bf16(lambda: Qwen2_5_VLForConditionalGeneration(encoder_config).eval(), device),
            "vae": in_bf16(lambda: AutoencoderKLQwenImage(**QWEN_IMAGE_VAE), device),
            "tokenizer": lambda: tokenizer, "scheduler": qwen_image_scheduler}


def qwen_image_pipeline_dir(directory: Path, tiny: bool, device: torch.device) -> tuple[Path, dict]:
    """A Qwen-Image pipeline directory with its transformer's weights (the published configs, qwen_image_makers, made
    from seed 0; or the tests' tiny ones, float32) and its transformer's config."""
    if not tiny:
        save_made_components(directory, "QwenImagePipeline", qwen_image_makers(device))
        return directory, dict(QWEN_IMAGE_TRANSFORMER)
    components = tiny_qwen_image_parts()
    config = {key: value for key, value in components["transformer"].config.items() if not key.startswith("_")}
    index = {"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "QwenImageTransformer2DModel"]}
    return save_pipeline_dir(directory, index, components, config), config


def free_memory() -> None:
    """Give the GPU back what dropped models held, before the server's workers need it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
