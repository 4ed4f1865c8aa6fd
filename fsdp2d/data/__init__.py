"""fsdp2d's data layer: documents from text, JSON lines, parquet, Arrow and ``datasets``
folders, tokenized once into memory-mapped token stores, mixed by weight, and batched
as a pure function of (seed, samples consumed).

One small module per concern: :mod:`~fsdp2d.data.detect` (what a file holds, by its
bytes), :mod:`~fsdp2d.data.files` (listing a folder, nothing read outside it),
:mod:`~fsdp2d.data.text`, :mod:`~fsdp2d.data.jsonl`, :mod:`~fsdp2d.data.arrow` (the
readers), :mod:`~fsdp2d.data.chunks` (the bounded pieces workers tokenize),
:mod:`~fsdp2d.data.tokenizer` (bytes or tokenizer.json, with BOS/EOS),
:mod:`~fsdp2d.data.encode`, :mod:`~fsdp2d.data.store` (tokens + document index +
manifest), :mod:`~fsdp2d.data.pretokenize` (streaming, parallel),
:mod:`~fsdp2d.data.split` (held-out documents), :mod:`~fsdp2d.data.mixture` (blending
and per-source order), :mod:`~fsdp2d.data.batches`, :mod:`~fsdp2d.data.scan` (ids below
the vocabulary), :mod:`~fsdp2d.data.build` (config -> a rank's data). The document ids of a document mask
come from the tokens' BOS/EOS: :func:`fsdp2d.models.document_ids`. See docs/data.md.

Example::

    from fsdp2d.data import build_data
    data = build_data(cfg, dp_rank=0)        # cfg: fsdp2d.train.config.JobConfig
    x, y = next(data.train)                  # (B, T) int64 each
    data.bos_id, data.eos_id                 # the ids that close documents, or None
"""

from .batches import Batches, EvalBatches
from .build import Prepared, build_data, prepare_data, source_specs
from .errors import DataError
from .files import list_files, resolve_data_path
from .mixture import PERIOD, Blend, SourceOrder
from .pretokenize import pretokenize
from .sources import SourceSpec, resolve_source
from .split import held_out, split_tokens
from .store import TokenStore, open_legacy, open_store, save_tokens
from .stream import TokenStream
from .tokenizer import Tokenizer, load_tokenizer
from .train_data import DataStateError, TrainData

__all__ = [
    "Batches", "EvalBatches", "Prepared", "build_data", "prepare_data", "source_specs", "DataError",
    "DataStateError", "list_files", "resolve_data_path", "PERIOD", "Blend", "SourceOrder", "pretokenize",
    "SourceSpec", "resolve_source", "held_out", "split_tokens", "TokenStore", "open_legacy", "open_store",
    "save_tokens", "TokenStream", "Tokenizer", "load_tokenizer", "TrainData",
]
