"""The parts of a served pipeline besides its transformer, eager as every rank runs them and compiled, on one GPU:

- the prompt's encoding, by the diffusers pipeline's `encode_prompt` (tokenization included): FLUX's (CLIP-L and
  T5-XXL, 512 T5 tokens) and Wan 2.1's (UMT5-XXL, the prompt and the negative prompt, 512 tokens); every rank runs it
  whole;
- FLUX's VAE decode of a 1024x1024 image, whole (what one GPU runs; on several the decode is split:
  benchmarks/vae_decode.py).

Random bf16 weights at the published configs (benchmarks/random_pipelines.py), batch 1. Variants (--variants):
- eager: as diffusers runs it, and a served pipeline today;
- blocks (text encoders): each encoder's repeated blocks (its `_no_split_modules`) compiled with dynamic shapes: one
  graph for any prompt count and length, what a served pipeline could compile at load;
- whole (text encoders): each encoder compiled whole into CUDA graphs (`mode="reduce-overhead"`, static shapes: a
  bound, not a plan);
- channels_last (VAE): the VAE's weights and latent in channels-last memory order, eager;
- compiled (VAE): the VAE's decoder compiled (static shapes); compiled_channels_last: both.

Each row: the harness's timer (CUDA events), the median of --iterations after --warmup calls (a compile is in the
warm-up, timed apart), and the largest relative error of the outputs against eager's (the harness's
`relative_error`, each output's norm).

    python benchmarks/replicated_components.py                              # everything, on cuda:0
    python benchmarks/replicated_components.py --parts vae --variants eager,compiled
    python benchmarks/replicated_components.py --device cpu --tiny          # tiny ones on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import time

import torch
from diffusers import AutoencoderKL, FluxPipeline, WanPipeline
from random_pipelines import CLIP_L, FLUX_PROMPT, FLUX_VAE, T5_XXL, UMT5_XXL, WAN_PROMPT
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

from mdtriton.harness import device_name, markdown_table, relative_error, time_calls, timing
from tests.pipeline.tiny_flux_pipeline import clip_tokenizer, t5_tokenizer, tiny_flux_pipeline
from tests.pipeline.tiny_wan_pipeline import tiny_wan_pipeline

PARTS = ("flux_text", "wan_text", "vae")
TEXT_VARIANTS = ("eager", "blocks", "whole")
VAE_VARIANTS = ("eager", "channels_last", "compiled", "compiled_channels_last")


def text_encoders(pipeline) -> list[torch.nn.Module]:
    return [module for name in ("text_encoder", "text_encoder_2") if (module := getattr(pipeline, name, None))]


def text_part(part: str, variant: str, tiny: bool, device: torch.device):
    """encode_prompt of the part's pipeline (its text encoders and tokenizers only; tiny: the tests' tiny pipeline's),
    prepared as variant says."""
    if part == "flux_text":
        if tiny:
            source = tiny_flux_pipeline()
            encoders = dict(text_encoder=source.text_encoder, text_encoder_2=source.text_encoder_2)
        else:
            with torch.device(device):
                encoders = dict(text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                                text_encoder_2=T5EncoderModel(T5Config(**T5_XXL)))
        pipeline = FluxPipeline(scheduler=None, vae=None, transformer=None, tokenizer=clip_tokenizer(),
                                tokenizer_2=t5_tokenizer(), **encoders)
        arguments = dict(prompt=[FLUX_PROMPT], prompt_2=None, device=device, max_sequence_length=512)
    else:
        if tiny:
            text_encoder = tiny_wan_pipeline().text_encoder
        else:
            with torch.device(device):
                text_encoder = UMT5EncoderModel(UMT5Config(**UMT5_XXL))
        pipeline = WanPipeline(scheduler=None, vae=None, transformer=None, tokenizer=t5_tokenizer(),
                               text_encoder=text_encoder)
        arguments = dict(prompt=[WAN_PROMPT], negative_prompt=[""], do_classifier_free_guidance=True,
                         max_sequence_length=512, device=device)
    pipeline.to(device, torch.bfloat16)
    for encoder in text_encoders(pipeline):
        encoder.eval()  # as from_pretrained leaves it: no dropout
        if variant == "blocks":
            for module in encoder.modules():
                if type(module).__name__ in encoder._no_split_modules:
                    module.compile(dynamic=True)
        elif variant == "whole":
            encoder.compile(mode="reduce-overhead")
    return lambda: pipeline.encode_prompt(**arguments)


def vae_part(variant: str, tiny: bool, device: torch.device):
    """FLUX's VAE decode of a 1024x1024 image's latent (tiny: the tests' tiny VAE, 64x64), prepared as variant says."""
    if tiny:
        vae = tiny_flux_pipeline().vae
    else:
        with torch.device(device):
            vae = AutoencoderKL(**FLUX_VAE)
    vae = vae.to(device, torch.bfloat16).eval()
    side = 8 if tiny else 128  # the latent's, 8x smaller than the image's
    latent = torch.randn(1, vae.config.latent_channels, side, side, generator=torch.Generator(device).manual_seed(0),
                         device=device, dtype=torch.bfloat16)
    if "channels_last" in variant:
        vae, latent = vae.to(memory_format=torch.channels_last), latent.to(memory_format=torch.channels_last)
    if variant.startswith("compiled"):
        vae.decoder.compile()
    return lambda: (vae.decode(latent).sample,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--variants", default=",".join(dict.fromkeys(TEXT_VARIANTS + VAE_VARIANTS)),
                        help="each part's of these (eager always runs first): text encoders "
                             f"{', '.join(TEXT_VARIANTS)}; VAE {', '.join(VAE_VARIANTS)} (default: all)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="tiny components (checks the script on the CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first, a compile among them (default 3)")
    parser.add_argument("--iterations", type=int, default=10, help="timed calls (default 10)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    asked = args.variants.split(",")
    rows = []
    for part in args.parts.split(","):
        variants = VAE_VARIANTS if part == "vae" else TEXT_VARIANTS
        reference = None
        for variant in ["eager"] + [name for name in variants if name in asked and name != "eager"]:
            torch.manual_seed(0)
            call = vae_part(variant, args.tiny, device) if part == "vae" else text_part(part, variant, args.tiny,
                                                                                        device)
            began = time.perf_counter()
            with torch.inference_mode():
                for _ in range(args.warmup):
                    call()
                if cuda:
                    torch.cuda.synchronize()
                warm_up_s = time.perf_counter() - began
                times, outputs = time_calls(call, cuda, 0, args.iterations)
            outputs = [output for output in outputs if isinstance(output, torch.Tensor)]
            reference = outputs if reference is None else reference
            error = max(relative_error(output, expected) for output, expected in zip(outputs, reference))
            result = timing(times)
            rows.append([part, variant, f"{result['median_ms']:.2f}", f"{result['min_ms']:.2f}", f"{warm_up_s:.1f}",
                         f"{error:.1e}"])
            print(" | ".join(rows[-1]), flush=True)
            del call
            torch.compiler.reset()
            if cuda:
                torch.cuda.empty_cache()
    print(f"\nA served pipeline's replicated parts, random bf16 weights at the published configs"
          f"{' (tiny)' if args.tiny else ''}, {device_name(device)}, median of {args.iterations}\n")
    print(markdown_table(["part", "variant", "median ms", "min ms", "warm-up s (compile)", "relative error vs eager"],
                         rows))


if __name__ == "__main__":
    main()
