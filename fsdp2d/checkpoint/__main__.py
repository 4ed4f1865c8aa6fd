"""``python -m fsdp2d.checkpoint {export,inspect}``: offline tools, no process group."""

import argparse
import sys

from ..hf.config import HFError
from . import CheckpointError, export, inspect
from ..hf.export import export_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp2d.checkpoint")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a Hugging Face-style full safetensors export")
    ex.add_argument("ckpt")
    ex.add_argument("out")
    ex.add_argument("--max-shard-gib", type=float, default=5.0, help="split files larger than this")
    ex.add_argument("--format", choices=("fsdp2d", "hf"), default="fsdp2d",
                    help="hf: Hugging Face names and config.json, loadable by transformers")
    ex.add_argument("--tokenizer", default=None,
                    help="hf: 'bytes' or a tokenizer.json to write beside the weights (default: the run's, as "
                         "the checkpoint records it)")
    ex.add_argument("--no-tokenizer", action="store_true", help="hf: write the model alone, no tokenizer files")
    ins = sub.add_parser("inspect", help="print tensors, shapes, dtypes, mesh and sizes")
    ins.add_argument("ckpt")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "export":
            size = int(args.max_shard_gib * 2**30)
            if args.tokenizer and args.no_tokenizer:
                parser.error("--tokenizer and --no-tokenizer: give one")
            if args.format == "hf":
                paths = export_hf(args.ckpt, args.out, max_shard_bytes=size,
                                  tokenizer=False if args.no_tokenizer else args.tokenizer)
            elif args.tokenizer or args.no_tokenizer:
                parser.error("--tokenizer and --no-tokenizer go with --format hf")
            else:
                paths = export(args.ckpt, args.out, max_shard_bytes=size)
            for path in paths:
                print(path)
        else:
            print(inspect(args.ckpt))
    except (CheckpointError, HFError, OSError) as exc:  # a damaged index is a CheckpointError, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
