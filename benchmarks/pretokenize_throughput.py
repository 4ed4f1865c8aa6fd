"""Pretokenize throughput and peak memory: fsdp2d's streaming pretokenize against
``tokenizers``' own batch encoding, in the same run, at two corpus sizes.

    .venv/bin/python benchmarks/pretokenize_throughput.py [--mb 100 200] [--workers 1 2 4]

Generates JSON-lines corpora of pseudo-English documents in a temporary folder (deleted
at the end; at least 200 MB for the larger one), trains a byte-level BPE of 8192 tokens
(with <s> and </s>) on a sample, then for each corpus size runs, each in a fresh process:

* ``encode_batch``: the file read line by line, each line parsed with ``json``, and
  ``Tokenizer.encode_batch`` (tokenizers' own Rust thread pool, all cores) on 1024
  documents at a time, ids collected into numpy: the library's batch encoding, streamed;
* ``fsdp2d N``: ``fsdp2d.data.pretokenize`` with N worker processes (1, 2, 4), writing the
  token store (tokens + document index + manifest).

Reported: wall time, MB/s of JSON input, tokens/s, and peak memory: of the whole process
tree (PSS sampled every 0.1 s from /proc/PID/smaps_rollup and summed, so pages the forked
workers share count once) and the peak RSS of the largest single process (``getrusage``
of the reaped children). Peak memory is the point: the streaming
pipeline holds only the chunks in flight, so it must not grow with the corpus size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his an were are which be this has had it not "
         "but also first one their its new after who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can state "
         "about national out known university united then made between american through team game season house "
         "music company film war government history music river population north south family including album "
         "naïve café über résumé 東京 данные").split()


def make_corpus(path: Path, mb: int, seed: int) -> int:
    """About ``mb`` MB of JSON lines, documents of 50-2000 words; returns the byte count."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    target, written = mb * 10**6, 0
    with open(path, "w") as f:
        while written < target:
            lengths = rng.integers(50, 2000, 256)
            picks = rng.choice(words, int(lengths.sum()))
            lines = []
            for doc in np.split(picks, np.cumsum(lengths)[:-1]):
                lines.append(json.dumps({"text": " ".join(doc.tolist()), "source": "bench"}) + "\n")
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode())
    return path.stat().st_size


def train_tokenizer(corpus: Path, out: Path) -> Path:
    import tokenizers

    sample = []
    with open(corpus) as f:
        for _, line in zip(range(2000), f):
            sample.append(json.loads(line)["text"])
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))
    return out


BASELINE = """
import json, sys, numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
count, batch = 0, []
def flush():
    global count
    for e in tok.encode_batch(batch, add_special_tokens=False):
        count += len(np.asarray(e.ids, dtype=np.uint16)) + 2
    batch.clear()
with open(sys.argv[1], "rb") as f:
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == 1024:
            flush()
flush()
print(json.dumps({"tokens": count}))
"""

FSDP2D = """
import json, sys
from fsdp2d.data import pretokenize
m = pretokenize(sys.argv[1], sys.argv[3], sys.argv[2], workers=int(sys.argv[4]), progress=False)
print(json.dumps({"tokens": m["tokens"]}))
"""


def _pss(pid: int) -> int:
    """Proportional set size (bytes): resident memory with shared pages divided among their sharers,
    so forked workers' shared imports are not counted once per worker."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_rss(root: int) -> int:
    """Summed PSS (bytes) of ``root`` and its descendants."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    return sum(_pss(p) for p in tree)


MEASURE = """
import json, resource, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from pretokenize_throughput import _tree_rss
t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE, text=True)
peak = 0
while proc.poll() is None:
    peak = max(peak, _tree_rss(proc.pid))
    time.sleep(0.1)
out = json.loads(proc.stdout.read())
out.update(seconds=time.perf_counter() - t0, peak_tree=peak,
           peak_process=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
print(json.dumps(out))
"""


def measure(cmd: list[str]) -> dict:
    """Run ``cmd`` in a fresh measuring process (so getrusage sees only its tree)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(Path(__file__).parent), *cmd], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[100, 200], help="corpus sizes (MB of JSON lines)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fsdp2d_pretok_"))
    rows = []
    try:
        print(f"load before: {os.getloadavg()}, {os.cpu_count()} CPUs", flush=True)
        corpora = {mb: tmp / f"corpus_{mb}.jsonl" for mb in args.mb}
        for mb, path in corpora.items():
            make_corpus(path, mb, seed=mb)
        tok = train_tokenizer(corpora[args.mb[0]], tmp / "tokenizer.json")
        for mb, path in corpora.items():
            size = path.stat().st_size
            runs = [("encode_batch (tokenizers, all threads)", [sys.executable, "-c", BASELINE, str(path), str(tok)])]
            runs += [(f"fsdp2d pretokenize, {w} worker{'s' if w > 1 else ''}",
                      [sys.executable, "-c", FSDP2D, str(path), str(tok), str(tmp / f"out_{mb}_{w}"), str(w)])
                     for w in args.workers]
            for name, cmd in runs:
                r = measure(cmd)
                rows.append((size, name, r))
                print(f"{size / 1e6:.0f} MB  {name:<40} {r['seconds']:7.1f} s {size / r['seconds'] / 1e6:6.2f} MB/s "
                      f"{r['tokens'] / r['seconds'] / 1e6:6.2f} Mtok/s  peak PSS tree {r['peak_tree'] / 2**20:7.0f} MiB, "
                      f"largest process {r['peak_process'] / 2**20:6.0f} MiB", flush=True)
                for out in tmp.glob("out_*"):  # the stores are not needed: keep /tmp small
                    shutil.rmtree(out)
        print(f"load after: {os.getloadavg()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| corpus | method | time | MB/s | tokens/s | peak PSS, process tree | peak RSS, largest process |")
    print("|---|---|---|---|---|---|---|")
    for size, name, r in rows:
        print(f"| {size / 1e6:.0f} MB | {name} | {r['seconds']:.1f} s | {size / r['seconds'] / 1e6:.2f} | "
              f"{r['tokens'] / r['seconds'] / 1e6:.2f} M | {r['peak_tree'] / 2**20:.0f} MiB | "
              f"{r['peak_process'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
