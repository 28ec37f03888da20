"""The ``shardwise`` command line: ``demo``, ``inspect PATH``, ``consolidate SRC DST``,
``verify PATH [--against MODEL]``, ``diff A B``, ``validate --backend NAME [--json OUT]``,
``check-plan MODEL``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from shardwise.demo import check_degree, run_demo

    try:
        check_degree(args.size, args.tp)
    except ValueError as e:  # an argparse usage error, before any rank is spawned
        args.subparser.error(f"argument --tp: {e}")
    return run_demo(tp=args.tp, size=args.size, keep=args.keep)


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.io.check import main_inspect

    return main_inspect(args.path, storage_options=args.storage_options)


def _consolidate(args: argparse.Namespace) -> int:
    import time

    from shardwise.errors import ShardwiseError
    from shardwise.io.consolidate import consolidate
    from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
    from shardwise.io.storage import locate, split_scheme

    start = time.perf_counter()
    try:
        out = consolidate(args.src, args.dst, max_shard_size=args.max_shard_size,
                          filename_prefix=args.prefix, overwrite=args.overwrite,
                          storage_options=args.storage_options)
    except ShardwiseError as e:
        # The library's refusals name its keyword; on the command line the fix is the flag.
        print(f"shardwise consolidate: {str(e).replace('overwrite=True', '--overwrite')}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    ckpt = resolve_checkpoint(locate(out, args.storage_options if split_scheme(out)[0] else None))
    print(f"wrote {out}: {len(ckpt.names)} tensors, {ckpt.total_size:,} bytes in {len(ckpt.files)} "
          f"file(s), {seconds:.1f} s")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from shardwise.io.check.verify import main_verify

    if args.against is None and (args.dtype is not None or args.layout != "auto"):
        args.subparser.error("--dtype and --layout apply to the comparison with a model: pass --against too")

    return main_verify(args.path, as_json=args.json, against=args.against, dtype=args.dtype,
                       layout=args.layout, storage_options=args.storage_options)


def _diff(args: argparse.Namespace) -> int:
    from shardwise.io.check.diff import main_diff

    return main_diff(args.a, args.b, as_json=args.json, atol=args.atol, rtol=args.rtol, dtype=args.dtype,
                     storage_options=args.storage_options)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of ranks")
    return value


def _storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", dest="storage_options", type=_storage_option, action="append",
                        default=None, metavar="KEY=VALUE",
                        help="an option of the storage a URL location (scheme://...) names (repeatable)")


_DESCRIPTION = ("Read, check and convert tensor-parallel PyTorch checkpoints: demo, inspect PATH, "
                "consolidate SRC DST, verify PATH [--against MODEL], diff A B, "
                "validate --backend NAME [--json OUT], check-plan MODEL.")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with ``command``, the one to be run, the options of the
    others that need torch (demo's model sizes, validate's suite) are left out, so that
    ``shardwise --help`` and the commands that read files import no torch to parse."""
    from shardwise import __version__

    # not the module's docstring: argparse would show its ``double backticks``
    parser = argparse.ArgumentParser(prog="shardwise", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream, save and reshard a small checkpoint on local gloo ranks")
    demo.add_argument("--tp", type=_positive_int, default=4,
                      help="tensor-parallel degree (ranks to spawn; divides the 8 heads: 1, 2, 4, 8)")
    if command in (None, "demo"):
        from shardwise.testing.model import SIZES

        demo.add_argument("--size", default="small", choices=list(SIZES), help="model size (default: small)")
    demo.add_argument("--keep", default=None, metavar="DIR",
                      help="write the checkpoint here and keep it (and what is saved, in DIR-saved)")
    demo.set_defaults(func=_demo, subparser=demo)
    inspect = sub.add_parser("inspect", help="describe a checkpoint: format, tensors, dtypes, size, layout")
    inspect.add_argument("path", help="a .safetensors file, an index, or a checkpoint folder (DCP too)")
    _add_storage_options(inspect)
    inspect.set_defaults(func=_inspect)
    merge = sub.add_parser("consolidate", help="turn a distributed checkpoint into safetensors (one process)")
    merge.add_argument("src", help="the distributed (DCP) checkpoint folder")
    merge.add_argument("dst", help="the folder to write")
    merge.add_argument("--max-shard-size", default="5GB", help="largest file: 5GB (default), 500MB, ...")
    merge.add_argument("--prefix", default="model", help="file name prefix (default: model)")
    merge.add_argument("--overwrite", action="store_true",
                       help="replace DST once the new one is complete")
    _add_storage_options(merge)
    merge.set_defaults(func=_consolidate)
    check = sub.add_parser("verify", help="check a checkpoint's structure and every tensor's checksum "
                                          "(exit 0 OK, 1 FAILED, 3 UNVERIFIED: no fault "
                                          "found, but no checksum covers every chunk; 4 UNREADABLE: "
                                          "no such path, or the storage refused or did not answer)")
    check.add_argument("path", help="a .safetensors file, an index, or a checkpoint folder (DCP too)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--against", default=None, metavar="MODEL_DIR_OR_CONFIG",
                       help="also check every tensor's name and shape against what this model (a folder "
                            "with config.json, or the file) holds in the checkpoint (exit 2 when the model "
                            "cannot be built)")
    check.add_argument("--dtype", default=None, metavar="DTYPE",
                       help="with --against: also check that every floating-point tensor is DTYPE "
                            "(bfloat16, BF16, ...); without it dtypes are not compared")
    check.add_argument("--layout", default="auto", choices=["auto", "hub", "module"],
                       help="with --against: the key layout to expect: hub (what save_pretrained "
                            "writes), module (the model's own names) or auto (default: the one the "
                            "checkpoint matches)")
    _add_storage_options(check)
    check.set_defaults(func=_verify, subparser=check)
    compare = sub.add_parser("diff", help="compare two checkpoints tensor by tensor, any layouts "
                                          "(exit 0 when identical or within --atol/--rtol, 1 when not, "
                                          "2 on an unreadable one)")
    compare.add_argument("a", help="the first checkpoint (safetensors or DCP)")
    compare.add_argument("b", help="the second checkpoint")
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    compare.add_argument("--atol", type=float, default=None, metavar="X",
                         help="accept values within |a - b| <= X + RTOL * |b| (default: byte for byte)")
    compare.add_argument("--rtol", type=float, default=None, metavar="Y",
                         help="relative tolerance (default 0)")
    compare.add_argument("--dtype", default=None, metavar="DTYPE",
                         help="cast floating-point values of both sides to DTYPE (bfloat16, BF16, ...) "
                              "before comparing: a bfloat16 save against its float32 source")
    _add_storage_options(compare)
    compare.set_defaults(func=_diff)
    plan_check = sub.add_parser("check-plan", help="which module does a plan break? shard a tiny model on "
                                                   "local gloo ranks and compare every module with one "
                                                   "process (exit 0 when all agree, 1 when not)")
    plan_check.add_argument("model", help="a transformers or diffusers class (transformers:LlamaForCausalLM, "
                                          "diffusers:Flux2Transformer2DModel, with --config), or "
                                          "module:function returning (model, inputs): inputs a tuple of "
                                          "positional arguments or a dict of keyword ones")
    plan_check.add_argument("--config", default=None, metavar="CONFIG_JSON",
                            help="the config.json (or its folder) a transformers or diffusers class is "
                                 "built from")
    plan_check.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    plan_check.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")
    plan_check.add_argument("--plan", default="auto", metavar="auto|PLAN_JSON",
                            help="the model's own plan (auto, default) or a JSON file of path -> style")
    plan_check.add_argument("--rtol", type=float, default=None, help="tolerance (default: by dtype)")
    plan_check.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    plan_check.set_defaults(func=_check_plan)
    suite = sub.add_parser("validate", help="the hardware validation suite: every scenario at every layout "
                                            "the world allows (exit 0 when none fails); run it under the "
                                            "backend's launcher, or with --nproc N")
    if command in (None, "validate"):
        from shardwise.validate import add_arguments, run

        add_arguments(suite)
        suite.set_defaults(func=run)
    return parser


def _check_plan(args) -> int:
    from shardwise.plan_cli import run  # torch and the gloo ranks: only when the command runs

    return run(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    args = parser.parse_args(argv)
    if getattr(args, "storage_options", None) is not None:
        args.storage_options = dict(args.storage_options)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`shardwise inspect X | head`): stop quietly, as other tools do.
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe
    return code


if __name__ == "__main__":
    sys.exit(main())
