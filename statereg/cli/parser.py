"""The `statereg` command line: its arguments, and `main`, which runs one command and turns
statereg's errors into messages and exit codes (0 ok, 1 damaged or failed, 2 usage)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from statereg.cli.common import _checkpoint_url, _verify_target
from statereg.cli.maintenance import cmd_cp, cmd_export_hf, cmd_gc
from statereg.cli.plan import cmd_plan, cmd_schema
from statereg.cli.reading import cmd_inspect, cmd_ls, cmd_verify
from statereg.errors import SpecError, StateregError, StorageError


def build_parser() -> argparse.ArgumentParser:
    from statereg import __version__

    parser = argparse.ArgumentParser(
        prog="statereg", description="Declarative PyTorch training checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show who writes which component, where and how")
    p.add_argument("file", help="statereg.yaml")
    p.add_argument("--world-size", type=int, default=1, help="ranks to plan for (default 1)")
    p.add_argument("--rank", type=int, default=None, help="print only this rank's plan")
    p.add_argument("--group", action="append", default=[], metavar="NAME=0,1/2,3",
                   help="the copies of a per_group process group (default: one over every rank)")
    p.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="build the model (on the meta device, no memory) to show bytes per rank")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes the ranks are spread over, for the tiers' memory per node "
                   "(default 1)")
    p.add_argument("--state-bytes", metavar="SIZE",
                   help="one checkpoint of the whole job's state, e.g. 30GB, for the tiers' "
                   "memory math (default: what --model measures)")
    p.add_argument("--json", action="store_true",
                   help="print the plan of each rank as one JSON document (without the "
                   "tiers block)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("schema", help="print the JSON Schema of statereg.yaml, of manifest.json "
                       "or of the documents --json prints (cli)")
    p.add_argument("which", nargs="?", choices=("spec", "manifest", "cli"), default="spec")
    p.add_argument("--path", action="store_true",
                   help="print where the installed schema file is (for an editor's YAML plugin)")
    p.set_defaults(run=cmd_schema)

    def json_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true",
                       help="print one JSON document (schema: `statereg schema cli`)")

    def storage_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--spec", help="take storage options from this statereg.yaml")
        p.add_argument("--options", help="storage options as a JSON object")

    p = sub.add_parser("ls", help="list committed checkpoints under a root (and, with tiers, "
                       "where each step lives)")
    p.add_argument("root", nargs="?",
                   help="checkpoint root: path or URL (default: storage.url of --spec)")
    p.add_argument("--memory", metavar="SHM_URL",
                   help="also show this memory tier root (default: the tiers of --spec)")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_ls)

    p = sub.add_parser("inspect", help="show a checkpoint's manifest: components, sizes, versions")
    p.add_argument("url", type=_checkpoint_url,
                   help="checkpoint path or URL, e.g. ./checkpoints/step_00000100")
    p.add_argument("--json", action="store_true",
                   help="print the manifest itself (schema: `statereg schema manifest`)")
    storage_args(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("verify", help="recompute every file's size and checksum of a "
                       "checkpoint, or of every checkpoint of a root")
    p.add_argument("target", type=_verify_target,
                   help="checkpoint path or URL, or a root to verify every committed "
                   "checkpoint of")
    p.add_argument("--latest", action="store_true",
                   help="with a root: verify only its newest checkpoint")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("gc", help="list (or --delete) leftovers of interrupted saves under a root")
    p.add_argument("root", help="checkpoint root: path or URL")
    p.add_argument("--delete", action="store_true",
                   help="remove the leftovers (default: a dry run that only lists them)")
    p.add_argument("--grace", default="1h",
                   help="keep leftovers younger than this, a save may be writing them "
                   "(seconds, or e.g. 30m, 1h; default 1h)")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_gc)

    p = sub.add_parser("export-hf",
                       help="write a checkpoint's model as a Hugging Face safetensors directory")
    p.add_argument("url", type=_checkpoint_url, help="checkpoint path or URL")
    p.add_argument("out_dir", help="directory (path or URL) for the safetensors files")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="convert floating-point tensors (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest file, e.g. 2GB, 500MB, 512MiB (default 5GB)")
    p.add_argument("--config", help="a config.json to copy beside the weights")
    p.add_argument("--component", help="the model component (default: the only one)")
    storage_args(p)
    p.set_defaults(run=cmd_export_hf)

    p = sub.add_parser("cp", help="copy a committed checkpoint to another root (any backends)")
    p.add_argument("src", type=_checkpoint_url,
                   help="checkpoint URL, e.g. s3://bkt/run/step_00000100")
    p.add_argument("dst", help="destination root; the checkpoint keeps its name")
    p.add_argument("--compression", choices=("zstd", "zstd-plain", "none"),
                   help="rewrite tensor files: zstd (float-aware), zstd-plain (readable by "
                   "plain DCP), none; default: copy the bytes as they are")
    p.add_argument("--level", type=int, default=3, choices=range(1, 20), metavar="1..19",
                   help="zstd level for --compression (default 3)")
    p.add_argument("--src-options", help="storage options for SRC only (JSON object)")
    p.add_argument("--dst-options", help="storage options for DST only (JSON object)")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_cp)
    return parser


_REMOTE = ("s3://", "s3a://", "gs://", "gcs://")


def _storage_hint(args: argparse.Namespace) -> str:
    """What to try when a remote store failed and no storage options were given at all."""
    given = [getattr(args, name, None)
             for name in ("root", "url", "target", "src", "dst", "out_dir")]
    remote = [str(u) for u in given if u and str(u).startswith(_REMOTE)]
    explicit = [getattr(args, name, None) for name in
                ("spec", "options", "src_options", "dst_options")]
    if not remote or any(explicit):
        return ""
    hint = ("; no --spec or --options was given, so the default cloud endpoint and credentials "
            "were used: pass --spec statereg.yaml (its storage.options) or --options '{...}'")
    if any(u.startswith(("s3://", "s3a://")) for u in remote):
        hint += (", or for an S3-compatible server set AWS_ENDPOINT_URL "
                 "(e.g. AWS_ENDPOINT_URL=http://127.0.0.1:9000)")
    return hint


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """statereg's warnings (a damaged checkpoint skipped, an entry not readable) on stderr,
    one line each, while a command runs, unless the program running it configured logging:
    the package logger has only a NullHandler, which leaves the choice to applications."""
    if logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package = logging.getLogger("statereg")
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _warnings_to_stderr():
            code = args.run(args)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit
    except StorageError as exc:
        print(f"statereg {args.command}: error: {exc}{_storage_hint(args)}", file=sys.stderr)
        return 1
    except StateregError as exc:
        print(f"statereg {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SpecError) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped early (`statereg schema | head -1`). Point stdout at /dev/null
        # so the final flush at exit cannot fail again, and exit as a tool killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    return code or 0
