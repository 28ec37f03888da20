"""The ``shardwise`` command line: ``demo``, ``inspect PATH``, ``consolidate SRC DST``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from shardwise.demo import run_demo

    return run_demo(tp=args.tp, size=args.size, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream a small checkpoint on local gloo ranks and compare")
    demo.add_argument("--tp", type=int, default=4, help="tensor-parallel degree (ranks to spawn)")
    demo.add_argument("--size", default="small", help="model size: tiny, small, medium")
    demo.add_argument("--keep", default=None, metavar="DIR", help="write the checkpoint here and keep it")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
