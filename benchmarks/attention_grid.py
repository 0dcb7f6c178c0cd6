"""FlashAttention-3's time by the multiprocessors it leaves free (`sm_margin`), at the shapes the context-parallel
methods hand it: the cost of leaving NCCL room beside a transfer (attention/local.py, NCCL_SMS, RING_NCCL_SMS).

FlashAttention-3 runs a persistent grid of one program per multiprocessor left, each taking its share of the tiles
(128 queries of one head each, at head dim 128), so its time follows the rounds, ceil(tiles / programs), more than
the multiprocessors: a margin costs nothing until it adds a round. One GPU, batch 1, random bf16 inputs, head dim 128;
the harness's timer (median of --iterations after 5 warm-up calls).

    python benchmarks/attention_grid.py --margins 0,4,8,12,16,20,24,28,32
"""

from __future__ import annotations

import argparse

import torch

from mdtriton.engine.attention import fa3
from mdtriton.harness import markdown_table, time_calls, timing

HEAD_DIM = 128
QUERY_TILE = 128  # the queries of one of its tiles at this head dim
# (what the shape is, queries, heads, keys): FLUX.1-dev at 4,096+512 and 16,384+512 tokens, Wan 2.1 14B at 720p.
SHAPES = [("FLUX 4k, 1 GPU", 4608, 24, 4608), ("FLUX 4k, allgather_kv 2", 2304, 24, 4608),
          ("FLUX 4k, a ring step of 2", 2304, 24, 2304), ("FLUX 4k, ulysses 2", 4608, 12, 4608),
          ("FLUX 4k, ulysses 4", 4608, 6, 4608), ("FLUX 4k, allgather_kv 4", 1152, 24, 4608),
          ("FLUX 4k, a ring step of 4", 1152, 24, 1152), ("FLUX 16k, ulysses 4", 16896, 6, 16896),
          ("FLUX 16k, a ring step of 2", 8448, 24, 8448), ("FLUX 16k, a ring step of 4", 4224, 24, 4224),
          ("Wan 720p, ulysses 4", 75600, 10, 75600)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--margins", default="0,4,8,12,16,20,24,28,32", help="sm_margin values to time")
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    if not fa3.available(device):
        raise SystemExit(f"FlashAttention-3 not usable here: {fa3.unavailable_reason(device)}")
    margins = [int(m) for m in args.margins.split(",")]
    generator = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name, queries, heads, keys in SHAPES:
        q = torch.randn(1, queries, heads, HEAD_DIM, generator=generator, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, keys, heads, HEAD_DIM, generator=generator, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        tiles = -(-queries // QUERY_TILE) * heads
        cells = [name, str(tiles)]
        for margin in margins:
            times, _ = time_calls(lambda: fa3.attention_with_lse(q, k, v, sm_margin=margin), True, 5, args.iterations)
            cells.append(f"{1000 * timing(times)['median_ms']:.1f}")
        rows.append(cells)
    name = torch.cuda.get_device_name(device)
    print(f"FlashAttention-3 on one {name}, microseconds a call by sm_margin:")
    print(markdown_table(["shape", "tiles"] + [f"margin {m}" for m in margins], rows))


if __name__ == "__main__":
    main()
