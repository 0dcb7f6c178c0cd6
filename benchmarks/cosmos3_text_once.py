"""What running Cosmos 3's text pathway once per request saves: one forward of our engine on one GPU (or the CPU) with
the text's token ids in (the text pathway at every call, as a transformer engine request and diffusers' model run it:
what `mdtriton bench --architecture cosmos3` times), with the text's keys and values handed in (a denoising step as
the pipeline runs it), and the text pathway alone, at the bench's requests (Family.media_request: 256 text tokens, 189
frames at 480p and 720p). Loaded as the server loads it (the harness's bench_engine: compiled and warmed up on a GPU),
random bf16 weights; the harness's timer, the median of --iterations after a first call. It takes the bench's model
arguments (mdtriton/harness.py: --preset, --config, --height, --width, --frames, --device).

    python benchmarks/cosmos3_text_once.py                     # cosmos3-15b, 480p and 720p x 189 frames, one GPU
    python benchmarks/cosmos3_text_once.py --height 720 --width 1280 --frames 1     # a 720p image
    python benchmarks/cosmos3_text_once.py --device cpu --preset tiny --height 32 --width 48 --frames 9
"""

from __future__ import annotations

import argparse
import json

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.cosmos3 import COSMOS3
from mdtriton.harness import (add_model_arguments, bench_engine, bench_weights, markdown_table, model_config,
                              model_sizes, precision, time_calls, timing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, ["cosmos3"])
    parser.add_argument("--iterations", type=int, default=3, help="timed calls after the first (default 3)")
    args = parser.parse_args()
    config = model_config(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype, data_type = precision(device)
    weights = bench_weights("cosmos3", config, ParallelPlan(), 0, device, dtype, None)
    engine = bench_engine("cosmos3", config, Communicator.single(device), weights, data_type)
    rows = []
    for size in model_sizes(args, config):
        request = {name: t.to(device) for name, t in COSMOS3.media_request(config, size.frames, size.height, size.width,
                                                                           dtype).items()}
        with torch.inference_mode():
            text = engine.module.text_keys_values(request["input_ids"], request["position_ids"])
        step = {**{name: t for name, t in request.items() if name != "input_ids"}, "text_keys_values": text}
        calls = {"text every call (ids in)": lambda: engine.forward(request),
                 "text once (keys and values in: the pipeline's step)": lambda: engine.forward(step),
                 "the text pathway alone": lambda: engine.module.text_keys_values(request["input_ids"],
                                                                                  request["position_ids"])}
        for name, call in calls.items():
            with torch.inference_mode():
                time_calls(call, cuda, 0, 1)
                times, _ = time_calls(call, cuda, 0, args.iterations)
            row = {"call": name, "size": str(size),
                   "tokens": COSMOS3.check_request(config, request).tokens, **timing(times)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown_table(["call", "size", "median ms", "min ms"],
                         [[row["call"], f"{row['size']} ({row['tokens']:,} tokens)", f"{row['median_ms']:,.1f}",
                           f"{row['min_ms']:,.1f}"] for row in rows]))


if __name__ == "__main__":
    main()
