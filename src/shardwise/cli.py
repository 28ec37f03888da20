"""The ``shardwise`` command line: ``demo``, ``inspect PATH``, ``consolidate SRC DST``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from shardwise.demo import run_demo

    return run_demo(tp=args.tp, size=args.size, keep=args.keep)


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.io.inspect import main_inspect

    return main_inspect(args.path)


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.errors import ShardwiseError
    from shardwise.io.consolidate import consolidate

    try:
        out = consolidate(args.src, args.dst, max_shard_size=args.max_shard_size,
                          filename_prefix=args.prefix, overwrite=args.overwrite)
    except ShardwiseError as e:
        print(f"shardwise consolidate: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream a small checkpoint on local gloo ranks and compare")
    demo.add_argument("--tp", type=int, default=4, help="tensor-parallel degree (ranks to spawn)")
    demo.add_argument("--size", default="small", help="model size: tiny, small, medium")
    demo.add_argument("--keep", default=None, metavar="DIR", help="write the checkpoint here and keep it")
    demo.set_defaults(func=_demo)
    inspect = sub.add_parser("inspect", help="describe a checkpoint: format, tensors, dtypes, size, layout")
    inspect.add_argument("path", help="a .safetensors file, an index, or a checkpoint folder (DCP too)")
    inspect.set_defaults(func=_inspect)
    merge = sub.add_parser("consolidate", help="turn a distributed checkpoint into safetensors (one process)")
    merge.add_argument("src", help="the distributed (DCP) checkpoint folder")
    merge.add_argument("dst", help="the folder to write")
    merge.add_argument("--max-shard-size", default="5GB", help="largest file: 5GB (default), 500MB, ...")
    merge.add_argument("--prefix", default="model", help="file name prefix (default: model)")
    merge.add_argument("--overwrite", action="store_true",
                       help="replace DST once the new one is complete")
    merge.set_defaults(func=_consolidate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
