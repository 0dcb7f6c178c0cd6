"""The VAE decode split across N GPUs by bands of rows (mdtriton/pipeline/split_vae.py, what a served pipeline runs)
against the whole decode on one GPU: FLUX.1's AutoencoderKL at 1024x1024 and Wan 2.1's AutoencoderKLWan at 1280x720
x 81 frames, random weights at the real VAEs' configs (the same on every GPU: made on the CPU from one seed), bf16 by
default, batch 1.

Each GPU count runs in its own processes (one per GPU, NCCL: the harness's run_ranks). Times: the harness's timer
(CUDA events, ranks lined up by a barrier) around whole `vae.decode` calls, the gather of the rows on every rank
included; the median of --iterations after one warm-up decode. Peak memory: the most any rank allocated during them.
The max uint8 difference compares each decode's image, rounded as diffusers' image processor rounds it, with the
one-GPU decode's, and with a float32 decode on one GPU (TF32 off: the dtype's own rounding, which a split decode
cannot be held to better than); the share of that image's levels strictly between 0 and 255 says how much of it random
weights left unclipped (what the comparison can see).

    python benchmarks/vae_decode.py                               # FLUX and Wan, 1, 2 and 4 GPUs, bf16
    python benchmarks/vae_decode.py --models wan --dtype float32  # Wan's VAE as the served pipeline runs it
    python benchmarks/vae_decode.py --tiny                        # tiny VAEs on 1, 2, 3 CPU ranks (gloo), float32
    python benchmarks/vae_decode.py --models flux --compile       # FLUX's decoder compiled, 1, 2 and 4 GPUs
    python benchmarks/vae_decode.py --models flux --profile       # and where one decode's GPU time goes, by kernel
    python benchmarks/vae_decode.py --models flux --graphs        # each decode replayed as a CUDA graph
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from safetensors.torch import load_file, save_file

from random_pipelines import FLUX_VAE
from tests.pipeline.tiny_flux_pipeline import tiny_flux_pipeline
from tests.pipeline.tiny_wan_pipeline import tiny_wan_pipeline

from mdtriton.bench import kernels_summary, profiled_kernels
from mdtriton.engine.comm import Communicator
from mdtriton.engine.cuda_graphs import CudaGraphForward
from mdtriton.engine.plan import ParallelPlan
from mdtriton.harness import device_name, init_rank, markdown_table, run_ranks, time_calls, timing
from mdtriton.pipeline.split_vae import split_decode

# model: (latent shape, size label), real and tiny (the tests' tiny pipelines' VAEs: make_vae). Latent rows 128 and
# 90 (7 and 5 tiny) split unevenly over 3 or 4 ranks.
MODELS = {"flux": ((1, 16, 128, 128), "1024x1024"), "wan": ((1, 16, 21, 90, 160), "1280x720 x 81")}
TINY_MODELS = {"flux": ((1, 2, 7, 5), "40x56"), "wan": ((1, 4, 3, 5, 6), "48x40 x 9")}
PROFILE_ROWS = 15  # kernels listed by --profile
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def levels(image: torch.Tensor) -> torch.Tensor:
    """uint8 levels of a decoded image in [-1, 1], rounded as diffusers' image processor rounds them."""
    return ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def float32_levels(vae: torch.nn.Module, latent: torch.Tensor) -> torch.Tensor:
    """The whole decode in float32 with TF32 off, eager (a compiled decoder too), as uint8 levels on the CPU (vae is
    left in float32)."""
    with (torch.inference_mode(), torch.backends.cudnn.flags(allow_tf32=False),
          torch.compiler.set_stance("force_eager")):
        return levels(vae.float().decode(latent.float()).sample).cpu().contiguous()


def decoder_call(vae: torch.nn.Module, graphs: bool):
    """latent -> image: vae.decode, or (graphs) its CUDA graph, captured at the first call, replayed."""
    if not graphs:
        return lambda latent: vae.decode(latent).sample
    graphed = CudaGraphForward(lambda latent: {"sample": vae.decode(latent).sample}, max_graphs=1)
    return lambda latent: graphed({"latent": latent})["sample"]


def profile_decode(decode, rank: int, title: str) -> None:
    """One decode under the profiler on every rank (their collectives need them all): rank 0 prints every rank's NCCL
    alone, idle and compute milliseconds (mdtriton.bench.kernels_summary) and its own GPU kernels' milliseconds by
    name, the most first."""
    with torch.inference_mode():
        kernels = profiled_kernels(decode)
    timeline = kernels_summary(kernels)
    if rank == 0:
        by_name = Counter()
        for name, start, end in kernels:
            by_name[name] += (end - start) / 1000
        total = sum(by_name.values())
        print(f"\n{title}: NCCL alone ms by rank {[round(ms, 2) for ms in timeline['exposed_ms']]}, idle "
              f"{[round(ms, 2) for ms in timeline['idle_ms']]}, compute {[round(ms, 2) for ms in timeline['compute_ms']]}"
              f"; rank 0's kernels, {total:.1f} ms in all:\n")
        print(markdown_table(["kernel", "ms", "share"], [[name[:90], f"{ms:.2f}", f"{100 * ms / total:.1f}%"]
                                                         for name, ms in by_name.most_common(PROFILE_ROWS)]),
              flush=True)


def make_vae(name: str, tiny: bool):
    """The model's VAE, the same on every rank (made on the CPU from one seed): at the real VAE's config (Wan 2.1's is
    AutoencoderKLWan's default), or the tests' tiny pipeline's."""
    if tiny:
        return tiny_flux_pipeline().vae if name == "flux" else tiny_wan_pipeline().vae
    torch.manual_seed(0)
    return AutoencoderKL(**FLUX_VAE) if name == "flux" else AutoencoderKLWan()


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, work_dir: str) -> None:
    cuda = not args.tiny
    device = init_rank(rank, world_size, port, cuda)
    comm = Communicator(ParallelPlan(cp_size=world_size), rank, device)
    comm.join_groups()
    rows = []
    for name in args.models:
        latent_shape, size = (TINY_MODELS if args.tiny else MODELS)[name]
        vae = make_vae(name, args.tiny).to(device, DTYPES[args.dtype]).eval()
        split = split_decode(vae, comm)
        if args.compile:
            vae.decoder.compile()
        latent = torch.randn(latent_shape, generator=torch.Generator().manual_seed(1)).to(device, DTYPES[args.dtype])
        decode = decoder_call(vae, args.graphs and cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            times, image = time_calls(lambda: decode(latent), cuda, 1, args.iterations)
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
        if world_size > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        if rank == 0:
            save_file({"levels": levels(image).cpu().contiguous()}, Path(work_dir) / f"{name}-{world_size}.safetensors")
            rows.append({"model": name, "size": size, "gpus": world_size, "split": split, **timing(times),
                         "peak_gib": float(peak)})
            print(json.dumps(rows[-1]), flush=True)
        if args.profile and cuda:
            profile_decode(lambda: decode(latent), rank, f"{name}, {world_size} GPU(s)")
        if world_size == 1:
            image = None
            save_file({"levels": float32_levels(vae, latent)}, Path(work_dir) / f"{name}-float32.safetensors")
        vae = image = decode = None  # a CUDA graph holding NCCL work goes before the process group (seen to hang)
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        (Path(work_dir) / f"rows-{world_size}.json").write_text(json.dumps(rows))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="flux,wan", help="flux, wan (default both)")
    parser.add_argument("--gpus", help="GPU counts (default 1,2,4; --tiny: CPU ranks 1,2,3); 1 is the baseline")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="the VAE's (default bfloat16; the served Wan pipeline runs its VAE in float32)")
    parser.add_argument("--iterations", type=int, default=3, help="timed decodes after one warm-up (default 3)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decoder (torch.compile, static shapes; split, it breaks at each exchange "
                             "between the ranks), in the warm-up decode; the float32 reference stays eager")
    parser.add_argument("--graphs", action="store_true",
                        help="replay each decode as a CUDA graph (captured in the warm-up decode; GPUs)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed decodes, one more under the profiler: every rank's NCCL alone, idle and "
                             "compute milliseconds, and rank 0's GPU kernels' time by name (GPUs)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny VAEs on CPU ranks, float32 (checks the "
                                                            "script)")
    args = parser.parse_args()
    args.models = args.models.split(",")
    if args.tiny:
        args.dtype = "float32"
    counts = sorted({1} | {int(n) for n in (args.gpus or ("1,2,3" if args.tiny else "1,2,4")).split(",")})
    if not args.tiny and max(counts) > torch.cuda.device_count():
        raise SystemExit(f"asked for {max(counts)} GPUs, {torch.cuda.device_count()} visible (--tiny runs on CPU)")
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for world_size in counts:
            problem = run_ranks(_rank_main, world_size, (args, work_dir))
            if problem:
                raise SystemExit(problem)
            rows += json.loads((Path(work_dir) / f"rows-{world_size}.json").read_text())
        for row in rows:
            image = load_file(Path(work_dir) / f"{row['model']}-{row['gpus']}.safetensors")["levels"]
            whole = load_file(Path(work_dir) / f"{row['model']}-1.safetensors")["levels"]
            row["max_level_difference"] = int((image.int() - whole.int()).abs().max())
            reference = load_file(Path(work_dir) / f"{row['model']}-float32.safetensors")["levels"]
            row["max_level_difference_float32"] = int((image.int() - reference.int()).abs().max())
            row["unclipped"] = float(((whole > 0) & (whole < 255)).float().mean())
    single = {row["model"]: row["median_ms"] for row in rows if row["gpus"] == 1}
    device = torch.device("cpu" if args.tiny else "cuda:0")
    ranks = "gloo" if args.tiny else "NCCL"
    compiled = ", the decoder compiled" if args.compile else ""
    print(f"\nVAE decode{compiled}, batch 1, {args.dtype}, {device_name(device)}, {ranks} ranks; median of "
          f"{args.iterations} decodes after one warm-up\n")
    print(markdown_table(
        ["VAE", "size", "GPUs", "decode", "median ms", "speed-up over 1 GPU", "peak GiB per GPU",
         "max uint8 difference vs 1 GPU", "vs float32 on 1 GPU", "unclipped levels"],
        [[row["model"], row["size"], row["gpus"], "split" if row["split"] else "whole", f"{row['median_ms']:,.1f}",
          f"{single[row['model']] / row['median_ms']:.2f}x", f"{row['peak_gib']:.2f}", row["max_level_difference"],
          row["max_level_difference_float32"],
          f"{100 * row['unclipped']:.0f}%"]
         for row in sorted(rows, key=lambda row: (row["model"], row["gpus"]))]))


if __name__ == "__main__":
    main()
