"""The benchmarks' pipeline directories (mdtriton.testing.random_pipelines, random_diffusers_pipelines), tiny: each is a
diffusers directory whose transformer/ holds the config the build reads, its class named as model_index.json names it;
and the published configs, made on the meta device, have the published models' sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mdtriton.testing.random_diffusers_pipelines import (FLUX2_DEV_TRANSFORMER, FLUX2_KLEIN_4B_TRANSFORMER,
                                                         GEMMA3_12B_TEXT, LTX2_CONNECTORS, LTX2_TRANSFORMER,
                                                         MISTRAL_SMALL_3_1_TEXT, QWEN3_4B, flux2_klein_makers,
                                                         flux2_klein_pipeline_dir, flux2_makers, flux2_pipeline_dir,
                                                         ltx2_makers, ltx2_pipeline_dir,
                                                         qwen_image_edit_plus_pipeline_dir)
from mdtriton.testing.random_pipelines import (QWEN2_5_VL_7B_TEXT, QWEN_IMAGE_TRANSFORMER, flux_pipeline_dir, in_bf16,
                                               kontext_pipeline_dir, qwen_image_makers, save_made_components,
                                               wan_pipeline_dir)
from mdtriton.testing.tiny_flux2_pipeline import flux2_scheduler, flux2_vae
from mdtriton.testing.tiny_qwen_image_pipeline import qwen_tokenizer


@pytest.mark.parametrize("make", [flux_pipeline_dir, kontext_pipeline_dir, wan_pipeline_dir,
                                  qwen_image_edit_plus_pipeline_dir, flux2_pipeline_dir, flux2_klein_pipeline_dir,
                                  ltx2_pipeline_dir])
def test_each_pipeline_directory_holds_its_transformer_config(make, tmp_path):
    pipeline_dir, config = make(tmp_path / "pipeline", True, torch.device("cpu"))
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    written = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    assert written["_class_name"] == index["transformer"][1]
    assert {key: written[key] for key in config} == json.loads(json.dumps(config))  # tuples as JSON lists


# Billions of parameters of the transformer and the text encoder (with its vision tower and, where it is not tied, its
# output layer) as the configs give them: the published names' sizes (Qwen-Image 20 B with Qwen2.5-VL 7 B, whose count
# takes in its vision tower and output layer; FLUX.2 [dev] 32 B with Mistral Small 3.1 24 B; FLUX.2 [klein] 4 B with
# Qwen3 4 B; LTX-2 19 B with Gemma 3 12 B).
PUBLISHED = {"qwen-image": (qwen_image_makers, 20.43, 8.29), "flux2": (flux2_makers, 32.2, 24.0),
             "flux2-klein": (flux2_klein_makers, 3.88, 4.02), "ltx2": (ltx2_makers, 18.9, 12.2)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_published_configs_have_the_published_sizes(name):
    makers, transformer, text_encoder = PUBLISHED[name]
    components = {part: makers(torch.device("meta"))[part]() for part in ("transformer", "text_encoder")}
    billions = {part: sum(p.numel() for p in model.parameters()) / 1e9 for part, model in components.items()}
    assert billions == {"transformer": pytest.approx(transformer, rel=0.01),
                        "text_encoder": pytest.approx(text_encoder, rel=0.01)}
    assert {p.dtype for model in components.values() for p in model.parameters()} == {torch.bfloat16}


def test_each_published_transformer_takes_its_text_encoders_width():
    """The pipelines stack hidden states of their text encoder (FLUX.2: three layers; LTX-2's connectors: every
    layer's and the embeddings'), which the transformer (or the connectors) must take."""
    assert QWEN_IMAGE_TRANSFORMER["joint_attention_dim"] == QWEN2_5_VL_7B_TEXT["hidden_size"]
    assert FLUX2_DEV_TRANSFORMER["joint_attention_dim"] == 3 * MISTRAL_SMALL_3_1_TEXT["hidden_size"]
    assert FLUX2_KLEIN_4B_TRANSFORMER["joint_attention_dim"] == 3 * QWEN3_4B["hidden_size"]
    assert (LTX2_CONNECTORS["caption_channels"], LTX2_CONNECTORS["text_proj_in_factor"]) == (
        GEMMA3_12B_TEXT["hidden_size"], GEMMA3_12B_TEXT["num_hidden_layers"] + 1)
    assert LTX2_TRANSFORMER["caption_channels"] == GEMMA3_12B_TEXT["hidden_size"]


def test_published_components_are_made_in_bf16_and_saved_as_a_pipeline_directory(tmp_path):
    """save_made_components and in_bf16, as the published pipelines are made (here with the tiny FLUX.2 VAE): each
    component saved in bf16 and listed in model_index.json with its library, the further entries kept, the default
    data type left as it was; the same seed gives the same weights."""
    makers = {"vae": in_bf16(flux2_vae, torch.device("cpu")), "tokenizer": qwen_tokenizer,
              "scheduler": flux2_scheduler}
    for name in ("a", "b"):
        save_made_components(tmp_path / name, "Flux2KleinPipeline", makers, {"is_distilled": True})
    assert torch.get_default_dtype() == torch.float32
    index = json.loads((tmp_path / "a" / "model_index.json").read_text())
    assert index == {"_class_name": "Flux2KleinPipeline", "is_distilled": True,
                     "vae": ["diffusers", "AutoencoderKLFlux2"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
                     "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    weights = [load_file(tmp_path / name / "vae" / "diffusion_pytorch_model.safetensors") for name in ("a", "b")]
    assert {tensor.dtype for tensor in weights[0].values() if tensor.is_floating_point()} == {torch.bfloat16}
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
