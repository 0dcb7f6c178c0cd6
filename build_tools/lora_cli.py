"""`mdtriton lora add | list | remove`: a pipeline model's LoRA adapters, in its model repository.

A server that serves the model needs no reload: the next request that names an added adapter gets it, and one that
names a removed adapter is refused."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "lora", help="add, list or remove a pipeline model's LoRA adapters",
        description="Manage the LoRA adapters of a pipeline model (FLUX, Wan) in its model repository. Requests "
                    "name them in their `loras` input (mdtriton generate --lora NAME=SCALE); a running server "
                    "reads an added adapter at the first request that names it, with no reload.")
    commands = parser.add_subparsers(required=True, metavar="ACTION")
    add = commands.add_parser(
        "add", help="check an adapter against the model and keep it",
        description="Read a LoRA file (diffusers/peft keys as save_lora_weights writes them, or a format diffusers' "
                    "loader of the model's pipeline converts: kohya, XLabs, BFL for FLUX; the original and musubi "
                    "formats for Wan), check each module it changes against every version of the model, and keep it "
                    "as MODEL/loras/NAME.safetensors.")
    add.add_argument("repository", type=Path, help="model repository directory")
    add.add_argument("model", help="the pipeline model's name")
    add.add_argument("path", type=Path,
                     help="a .safetensors file, or a directory holding pytorch_lora_weights.safetensors")
    add.add_argument("--name", required=True,
                     help="the adapter's name in requests (1 to 100 letters, digits, '.', '_', '-', starting with a "
                          "letter or digit)")
    add.set_defaults(run=add_command)
    listing = commands.add_parser("list", help="the model's adapters", description="List the model's adapters: "
                                  "name, modules changed, ranks, file size.")
    listing.add_argument("repository", type=Path, help="model repository directory")
    listing.add_argument("model", help="the pipeline model's name")
    listing.set_defaults(run=list_command)
    remove = commands.add_parser("remove", help="remove an adapter", description="Remove an adapter: requests that "
                                 "name it are refused from now on.")
    remove.add_argument("repository", type=Path, help="model repository directory")
    remove.add_argument("model", help="the pipeline model's name")
    remove.add_argument("name", help="the adapter's name")
    remove.set_defaults(run=remove_command)


def add_command(args: argparse.Namespace) -> int:
    from mdtriton.build_tools.adapters import add_adapter  # diffusers and peft (the `pipeline` extra)

    added = add_adapter(args.repository, args.model, args.path, args.name)
    print(f"added {added.name} to {args.model}: {added.modules} modules, rank {describe_ranks(added.ranks)}, "
          f"{added.bytes / 2**20:.1f} MiB")
    return 0


def list_command(args: argparse.Namespace) -> int:
    from mdtriton.build_tools.adapters import list_adapters

    adapters = list_adapters(args.repository, args.model)
    if not adapters:
        print(f"{args.model} has no adapters (mdtriton lora add)")
    for adapter in adapters:
        print(f"{adapter.name}\t{adapter.modules} modules\trank {describe_ranks(adapter.ranks)}\t"
              f"{adapter.bytes / 2**20:.1f} MiB")
    return 0


def remove_command(args: argparse.Namespace) -> int:
    from mdtriton.build_tools.adapters import remove_adapter

    remove_adapter(args.repository, args.model, args.name)
    print(f"removed {args.name} from {args.model}")
    return 0


def describe_ranks(ranks: tuple[int, ...]) -> str:
    return "/".join(str(rank) for rank in ranks)
