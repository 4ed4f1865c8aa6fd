"""``fsdp2d generate CKPT --prompt "..."``: sample text from a checkpoint on one process.

The checkpoint (saved on any mesh) is read into an unparallelized fsdp2d model built
from its ``extra["model"]`` spec (written by the launcher). The tokenizer, unless
``--tokenizer`` names one (a tokenizer.json or its folder, or ``bytes``), is the run's,
found from any directory: the one the checkpoint records (``extra["tokenizer"]``: what the
run's tokens were made with, an absolute path, checked against its sha256; a file gone or
changed, or tokens that named no tokenizer, are refused in one line, never guessed), else,
for checkpoints of earlier versions, ``data.tokenizer`` of ``RUN/config.toml`` (next to
``RUN/checkpoints/``), which a relative path is read against the folder the run was
started from (the run folder less ``metrics.runs_dir/run_name``), then against the
current one (``bytes`` when nothing names one). Sampling: temperature (0 = greedy) and top-k, seeded. No KV cache: each new
token re-runs the (short) context, which is plenty for small models.

On CPU, with ``OMP_NUM_THREADS`` unset, torch gets one thread per core this process may
use that the load average leaves idle (at least one): on a busy machine extra threads
spin against the other processes (measured in issue 32: 91 s at load ~10 with the
default, 15 s with one thread). Progress goes to stderr, the text to stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import tomllib
from pathlib import Path

import torch

from fsdp2d import checkpoint
from fsdp2d.models import GPT2, Llama
from fsdp2d.data.tokenizer import file_sha256, tokenizer_file
from fsdp2d.hf.tokenizer import recorded_tokenizer
from fsdp2d.hf.weights import HFError, args_from_spec

__all__ = ["load_model", "sample", "find_tokenizer", "cpu_threads", "main"]


def load_model(ckpt: str | Path) -> torch.nn.Module:
    """The fsdp2d model of checkpoint ``ckpt``, full weights on this process, eval mode."""
    index = checkpoint.read_index(ckpt)
    spec = index.get("extra", {}).get("model") or index.get("model")
    if spec is None:
        raise checkpoint.CheckpointError(f"{ckpt}: no extra['model'] (saved by an older fsdp2d train?): "
                                         f"cannot tell which model to build")
    arch, args = args_from_spec(spec)
    model = (Llama if arch == "llama" else GPT2)(args)
    checkpoint.load(ckpt, model)
    return model.eval()


@torch.no_grad()
def sample(model: torch.nn.Module, ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
           top_k: int | None = 50, seed: int = 0, progress=None, every_s: float = 5.0) -> list[int]:
    """``ids`` followed by ``max_new_tokens`` sampled tokens (greedy at temperature 0).
    ``progress(n)`` is called every ``every_s`` seconds with the tokens generated so far."""
    limit = model.args.max_seq_len if isinstance(model, Llama) else model.args.block_size
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    shown = time.perf_counter()
    for n in range(max_new_tokens):
        if progress is not None and time.perf_counter() - shown > every_s:
            progress(n)
            shown = time.perf_counter()
        context = torch.tensor([out[-limit:]])  # (1, T)
        logits = model(context)[0, -1].float()  # (V,)
        if temperature <= 0:
            out.append(int(logits.argmax()))
            continue
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


def cpu_threads() -> int:
    """Threads for a CPU run (see the module doc); ``OMP_NUM_THREADS`` wins when set."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    idle = cores - os.getloadavg()[0] if hasattr(os, "getloadavg") else cores
    return max(1, min(cores, int(idle + 0.5)))


def _config_candidates(ckpt: Path) -> list[Path] | None:
    """Where ``data.tokenizer`` of the run's config.toml may be (None: it says ``bytes``)."""
    run = ckpt.resolve().parent.parent
    config = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").is_file() else {}
    name = config.get("data", {}).get("tokenizer", "bytes")
    if name == "bytes":
        return None
    tried = [Path(name).expanduser()]
    runs_dir = Path(config.get("metrics", {}).get("runs_dir", "runs"))
    if not tried[0].is_absolute() and not runs_dir.is_absolute() and len(runs_dir.parts) < len(run.parents):
        tried.insert(0, run.parents[len(runs_dir.parts)] / name)  # the folder the run was started in
    return tried


def find_tokenizer(ckpt: Path, index: dict | None = None) -> str:
    """The run's tokenizer for checkpoint ``ckpt``: ``"bytes"`` or an existing file path
    (module doc). ValueError, one line naming the places tried and ``--tokenizer``, when
    the recorded file is gone (and not found, with its sha256, where config.toml names it)
    or changed, when the run's tokens named no tokenizer, or when config.toml's is not found."""
    extra = (index or {}).get("extra", {})
    if "tokenizer" not in extra:  # a checkpoint of an earlier version, or of one's own script
        tried = _config_candidates(ckpt)
        if tried is None:  # nothing names one: the byte tokenizer
            return "bytes"
        found = next((p for p in tried if p.exists()), None)
        if found is None:
            raise ValueError(f"the run's tokenizer is not at {' or '.join(map(str, tried))}: pass --tokenizer PATH")
        return str(tokenizer_file(found))
    if extra["tokenizer"] is None:
        raise ValueError(f"{ckpt} was trained on token files that name no tokenizer: pass --tokenizer PATH "
                         f"(the tokenizer.json they were made with, or 'bytes')")
    try:
        return recorded_tokenizer(index, ckpt)  # what the tokens were made with, checked by its sha256
    except HFError as exc:
        gone = exc
    name, sha = Path(extra["tokenizer"]), extra.get("tokenizer_sha256")
    tried = [p for p in _config_candidates(ckpt) or [] if tokenizer_file(p) != name.resolve()]
    for p in tried:  # the project moved: the relative data.tokenizer, if it is the same file
        if p.exists() and (not sha or file_sha256(tokenizer_file(p)) == sha):
            return str(tokenizer_file(p))
    if name.is_file() or not tried:
        raise ValueError(str(gone)) from None
    with_sha = f" (sha256 {sha})" if sha else ""
    raise ValueError(f"the run's tokenizer{with_sha} is not at {' or '.join(map(str, [name, *tried]))}: "
                     f"pass --tokenizer PATH") from None


def _codec(ckpt: Path, tokenizer: str | None):
    """(encode, decode) of the run's tokenizer (bytes when nothing says otherwise)."""
    if tokenizer is None:
        tokenizer = find_tokenizer(ckpt, checkpoint.read_index(ckpt))
    if tokenizer == "bytes":
        return (lambda s: list(s.encode())), (lambda ids: bytes(i % 256 for i in ids).decode(errors="replace"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file(tokenizer)))  # (a folder: its tokenizer.json)
    return (lambda s: tok.encode(s, add_special_tokens=False).ids), tok.decode


def _prompt_ids(ckpt: Path, tokenizer: str | None, prompt: str, model: torch.nn.Module) -> list[int]:
    """The prompt's ids; ``ValueError`` for an unreadable tokenizer, an empty prompt or ids
    outside the model's vocabulary (a tokenizer that is not the run's)."""
    try:
        encode, _ = _codec(ckpt, tokenizer)
    except ValueError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or damaged file
        raise ValueError(f"--tokenizer {tokenizer}: cannot be read: {exc}") from exc
    ids = encode(prompt)
    if not ids:
        raise ValueError(f"--prompt {prompt!r} encodes to no tokens")
    if max(ids) >= model.args.vocab_size:
        raise ValueError(f"the prompt's token id {max(ids)} is outside the model's vocabulary "
                         f"({model.args.vocab_size}): is --tokenizer the run's?")
    return ids


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsdp2d generate", description="sample text from a checkpoint")
    parser.add_argument("ckpt", help="a checkpoint folder, e.g. runs/debug_cpu/checkpoints/step_00000300")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None,
                        help="'bytes' or a tokenizer.json or its folder (default: the run's, as the checkpoint records it)")
    args = parser.parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k),
                        ("--temperature", args.temperature)):
        if not (math.isfinite(value) and value >= 0):
            parser.error(f"{flag}={value} must be a finite number >= 0")
    ckpt, t0 = Path(args.ckpt), time.perf_counter()
    torch.set_num_threads(cpu_threads())
    say = lambda what: print(f"[+{time.perf_counter() - t0:.1f}s] {what}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        model = load_model(ckpt)
        ids = _prompt_ids(ckpt, args.tokenizer, args.prompt, model)
    except (checkpoint.CheckpointError, HFError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    say(f"loaded {ckpt} ({sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}); "
        f"generating {args.max_new_tokens} tokens")
    _, decode = _codec(ckpt, args.tokenizer)
    out = sample(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                 progress=lambda n: say(f"{n}/{args.max_new_tokens} tokens"))
    print(decode(out))
    return 0
