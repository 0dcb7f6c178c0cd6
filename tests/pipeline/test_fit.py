"""The pipeline fit check (mdtriton.pipeline.fit): what a rank of a pipeline holds, estimated from the directory's
safetensors headers before anything is loaded (FLUX.2 [dev]'s text encoder on rank 0 only), and a rank that does not
fit refused naming each component; and the models of a pipeline loaded straight onto the rank's device
(mdtriton.pipeline.engine.models_on_device)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.repository import ENGINE_DIR
from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.memory import GIB, WORKING_MEMORY_BYTES, rank_weight_bytes
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families import family, served_part
from mdtriton.families.flux import FLUX
from mdtriton.families.flux2 import FLUX2, FLUX2_KLEIN
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG
from mdtriton.pipeline.engine import models_on_device
from mdtriton.pipeline.fit import check_pipeline_fits, components_bytes, engines_bytes, ranks_components
from mdtriton.testing.tiny_flux_pipeline import save_tiny_flux_pipeline
from mdtriton.testing.tiny_qwen_image_pipeline import save_tiny_qwen_image_pipeline
from mdtriton.testing.tiny_wan_pipeline import save_tiny_wan_pipeline

# Wan: our engine serves the transformer, the VAE is loaded in float32; Qwen-Image: diffusers' own transformer, held
# whole by every rank with the rest.
PIPELINES = {"wan-pipeline": save_tiny_wan_pipeline, "qwen-image-pipeline": save_tiny_qwen_image_pipeline}


@pytest.fixture(scope="module")
def pipeline_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {architecture: save(root / architecture) for architecture, save in PIPELINES.items()}


def loaded_bytes(pipeline_dir, data_type: str, float32_components, leave_out) -> dict[str, int]:
    """Bytes of every tensor in each component's safetensors files, read whole, at the data type the pipeline loads it
    in (floating point: data_type, or float32 for float32_components; others as stored)."""
    sizes = {}
    for folder in sorted(path for path in pipeline_dir.iterdir() if path.is_dir() and path.name not in leave_out):
        dtype = torch.float32 if folder.name in float32_components else TORCH_DTYPES[data_type]
        tensors = [tensor for path in folder.glob("*.safetensors") for tensor in load_file(path).values()]
        if tensors:
            sizes[folder.name] = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                                     for t in tensors)
    return sizes


@pytest.mark.parametrize("data_type", ["BF16", "FP32"])
@pytest.mark.parametrize("architecture", PIPELINES)
def test_the_estimate_is_each_components_tensor_bytes_at_the_served_data_type(pipeline_dirs, architecture,
                                                                               data_type):
    part = served_part(architecture)
    estimate = components_bytes(pipeline_dirs[architecture], data_type, part.float32_components, part.transformers)
    expected = loaded_bytes(pipeline_dirs[architecture], data_type, part.float32_components, part.transformers)
    assert estimate == expected
    assert ("transformer" in estimate) == (architecture == "qwen-image-pipeline")
    if part.float32_components:  # Wan's VAE counts 4 bytes a weight whatever the engine's data type
        assert estimate["vae"] == loaded_bytes(pipeline_dirs[architecture], "FP32", (), ())["vae"]


@pytest.mark.parametrize("architecture, folders", [("qwen-image-pipeline", ("transformer",)),
                                                    ("wan-pipeline", ("text_encoder", "vae"))])
def test_a_component_with_only_its_config_is_counted_from_its_class(pipeline_dirs, tmp_path, architecture, folders):
    """A build with random weights: transformer/ holds only config.json (a diffusers class); a transformers text
    encoder and a VAE kept in float32 likewise."""
    part, with_weights = served_part(architecture), pipeline_dirs[architecture]
    config_only = shutil.copytree(with_weights, tmp_path / "pipeline")
    for folder in folders:
        for weights in (config_only / folder).glob("*.safetensors"):
            weights.unlink()
        assert "config.json" in [path.name for path in (config_only / folder).iterdir()]
    expected = loaded_bytes(with_weights, "BF16", part.float32_components, part.transformers)
    assert components_bytes(config_only, "BF16", part.float32_components, part.transformers) == expected


def test_a_rank_that_fits_passes_and_one_byte_less_is_refused_naming_each_component(pipeline_dirs):
    components = components_bytes(pipeline_dirs["qwen-image-pipeline"], "FP32", ())
    needed = sum(components.values()) + WORKING_MEMORY_BYTES
    check_pipeline_fits(components, {}, None, "FP32", 0, needed, "free")
    with pytest.raises(EngineError) as caught:
        check_pipeline_fits(components, {}, None, "FP32", 1, needed - 1, "free")
    message = str(caught.value)
    assert all(f"{name} 0.0 GiB" in message for name in ("text_encoder", "transformer", "vae"))
    assert "tokenizer" not in message and "scheduler" not in message
    assert f"{needed / GIB:.1f} GiB in all, but GPU 1 has {(needed - 1) / GIB:.1f} GiB free" in message
    assert "--dtype BF16" in message and "--tp" not in message  # diffusers' own transformer takes no --tp


def test_flux2_dev_at_its_published_size_fits_an_h200_not_an_80_gb_gpu():
    """FLUX.2 [dev] in bf16: a 32 B transformer (diffusers' own) and a 24 B text encoder (Mistral Small 3.1) on every
    rank."""
    components = {"text_encoder": 24 * 10**9 * 2, "transformer": 32 * 10**9 * 2, "vae": 84 * 10**6 * 2}
    check_pipeline_fits(components, {}, None, "BF16", 0, 143771 * (1 << 20), "in all")
    with pytest.raises(EngineError) as caught:
        check_pipeline_fits(components, {}, None, "BF16", 0, 80 * GIB, "in all")
    message = str(caught.value)
    assert ("holds text_encoder 44.7 GiB, transformer 59.6 GiB, vae 0.2 GiB and 4 GiB of working memory, 108.5 GiB "
            "in all, but GPU 0 has 80.0 GiB in all") in message
    assert "serve it on GPUs with 108.5 GiB in all or more" in message and "--dtype" not in message


def test_flux2_dev_holds_its_text_encoder_on_rank_0_only():
    """On 2 ranks rank 0 encodes the prompts (mdtriton.pipeline.encoder): rank 1 holds the transformer and the VAE
    (63.8 GiB with the working memory: it fits an 80 GB GPU), rank 0 the text encoder too (refused there). [klein], an
    elastic plan and one rank keep the text encoder on every rank."""
    components = {"text_encoder": 24 * 10**9 * 2, "transformer": 32 * 10**9 * 2, "vae": 84 * 10**6 * 2}
    ulysses = ParallelPlan(cp_size=2, cp_method="ulysses")
    ranks = ranks_components(components, FLUX2, ulysses)
    assert ranks == [components, {"transformer": components["transformer"], "vae": components["vae"]}]
    check_pipeline_fits(ranks[1], {}, None, "BF16", 1, 80 * GIB, "in all")
    with pytest.raises(EngineError, match="108.5 GiB in all, but GPU 0 has 80.0 GiB in all"):
        check_pipeline_fits(ranks[0], {}, None, "BF16", 0, 80 * GIB, "in all")
    elastic = ParallelPlan(cp_size=2, cp_method="ulysses", elastic=True)
    for part, plan in ((FLUX2_KLEIN, ulysses), (FLUX2, elastic), (FLUX2, ParallelPlan())):
        assert ranks_components(components, part, plan) == [components] * plan.world_size


def dev_manifest(plan: ParallelPlan) -> Manifest:
    inputs, outputs = FLUX.signature(FLUX_DEV_CONFIG, "BF16")
    return Manifest("flux", FLUX_DEV_CONFIG, plan, "BF16", inputs, outputs)


def test_our_transformer_engine_counts_its_rank_and_the_advice_is_a_tp_size_that_fits():
    """FLUX.1-dev's engine (22.2 GiB a rank on one GPU) beside T5-XXL, CLIP-L and the VAE in bf16."""
    components = {"text_encoder": 123 * 10**6 * 2, "text_encoder_2": 4_762 * 10**6 * 2, "vae": 84 * 10**6 * 2}
    engines = {"transformer": dev_manifest(ParallelPlan())}
    memory = 32 * GIB
    with pytest.raises(EngineError) as caught:
        check_pipeline_fits(components, engines, FLUX, "BF16", 0, memory, "in all")
    message = str(caught.value)
    assert "text_encoder_2 8.9 GiB" in message and "transformer 22.2 GiB" in message
    tp = int(message.split("build it with --tp ")[1].split()[0])
    rest = sum(components.values()) + WORKING_MEMORY_BYTES

    def fits(tp_size: int) -> bool:
        return rest + rank_weight_bytes(FLUX, FLUX_DEV_CONFIG, ParallelPlan(tp_size=tp_size), "BF16") <= memory

    assert fits(tp) and not fits(tp - 1)
    check_pipeline_fits(components, {"transformer": dev_manifest(ParallelPlan(tp_size=tp))}, FLUX, "BF16", 0, memory,
                        "in all")


def test_a_built_pipelines_engine_directory_counts_its_components_and_its_engines_rank(tmp_path):
    """What a rank checks at load: the engine directory's components (its model_index.json lists no transformer) and
    its transformer engine's rank by the engine's manifest."""
    pipeline_dir = save_tiny_flux_pipeline(tmp_path / "pipeline")
    build_model_version(tmp_path / "repository", "flux", BuildRequest(
        "flux-pipeline", None, ParallelPlan(tp_size=2), "FP32", "cpu", weights_path=pipeline_dir, progress=False))
    engine_dir = tmp_path / "repository" / "flux" / "1" / ENGINE_DIR
    part = served_part("flux-pipeline")
    components = components_bytes(engine_dir, "FP32", part.float32_components)
    assert components == loaded_bytes(pipeline_dir, "FP32", (), ("transformer",))
    engine = Manifest.read(engine_dir / "transformer")
    sizes = engines_bytes({"transformer": engine}, family("flux"))
    assert sizes == {"transformer": rank_weight_bytes(FLUX, engine.config, engine.plan, "FP32")}
    assert 0 < sizes["transformer"] < loaded_bytes(pipeline_dir, "FP32", (), ())["transformer"]  # half, and more


@pytest.mark.parametrize("architecture", PIPELINES)
def test_models_on_device_are_the_models_diffusers_loads(pipeline_dirs, architecture):
    """On CPU here (a GPU rank gives its GPU): the same weights in the same data types, each model taken by the
    pipeline as given."""
    part, pipeline_dir = served_part(architecture), pipeline_dirs[architecture]
    dtypes = {"default": torch.bfloat16, **dict.fromkeys(part.float32_components, torch.float32)}
    models = models_on_device(pipeline_dir, dtypes, torch.device("cpu"), part.transformers)
    models_listed = [name for name, entry in json.loads((pipeline_dir / "model_index.json").read_text()).items()
                     if name in ("text_encoder", "transformer", "vae") and name not in part.transformers]
    assert sorted(models) == sorted(models_listed)
    given = DiffusionPipeline.from_pretrained(pipeline_dir, **dict.fromkeys(part.transformers), **models, dtype=dtypes,
                                              local_files_only=True)
    loaded = DiffusionPipeline.from_pretrained(pipeline_dir, **dict.fromkeys(part.transformers), dtype=dtypes,
                                               local_files_only=True)
    for name, model in models.items():
        assert getattr(given, name) is model
        ours, theirs = model.state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys()
        for key, tensor in ours.items():
            assert tensor.dtype == theirs[key].dtype and torch.equal(tensor, theirs[key]), f"{name}: {key}"
    if part.float32_components:
        assert models["vae"].dtype == torch.float32 and models["text_encoder"].dtype == torch.bfloat16


@pytest.mark.gpu
def test_models_on_device_are_on_the_ranks_gpu_only(pipeline_dirs):
    """The last GPU: no model lands on GPU 0 (as a pipeline-wide device_map "cuda" would put transformers' there)."""
    gpu = torch.device("cuda", torch.cuda.device_count() - 1)
    on_gpu0 = torch.cuda.memory_allocated(0)
    models = models_on_device(pipeline_dirs["qwen-image-pipeline"], {"default": torch.bfloat16}, gpu, ())
    assert models and all(tensor.device == gpu for model in models.values()
                          for tensor in [*model.parameters(), *model.buffers()])
    if gpu.index > 0:
        assert torch.cuda.memory_allocated(0) == on_gpu0
