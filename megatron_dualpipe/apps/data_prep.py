"""``megatron-dualpipe prepare-data``: text -> tokenizer -> Megatron's indexed dataset, cached by a hash
of the documents and settings, built aside and renamed into place (an interrupted run leaves nothing
half-written). The split is checked because Megatron loops forever in ``GPTDataset._get_num_epochs``
on a split of positive weight that gets no document. Standard library only at import (``--help``).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from .progress import Progress

FORMAT_VERSION = 1
EOD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 1024
MIN_VOCAB_SIZE = 257          # the 256 byte symbols and the end-of-document token
DEFAULT_SPLIT = "90,10,0"     # train, validation, test weights; no test split by default
PREFIX_NAME = "text_document"
TOKENIZER_DIR = "tokenizer"
MANIFEST = "manifest.json"
SPLIT_NAMES = ("train", "validation", "test")
TEXT_SUFFIXES = (".txt", ".jsonl")
#: End-of-document tokens looked for in a given tokenizer that names none.
KNOWN_EOD_TOKENS = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class DataError(ValueError):
    """A user error in the data set-up; its message is one line that names the fix."""


@dataclass(frozen=True)
class Corpus:
    """The documents, in order, and where they came from (for messages and the manifest)."""

    documents: Tuple[str, ...]
    source: str

    @property
    def characters(self) -> int:
        return sum(len(d) for d in self.documents)


def python_help_texts() -> Corpus:
    """The help texts that ship with CPython (``help('topics')``), one document per topic."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return Corpus(tuple(topics[k] for k in sorted(topics)), "Python's help texts (pydoc_data.topics)")


def read_corpus(paths: Sequence[str], json_key: str) -> Corpus:
    """Documents from directories, .txt and .jsonl files; Python's help texts when empty."""
    if not paths:
        return python_help_texts()
    files: List[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"no .txt or .jsonl files in {p}")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in TEXT_SUFFIXES:
                raise DataError(f"{p}: give .txt files (one document each), .jsonl files (one JSON object "
                                f"with a {json_key!r} field per line) or directories of them")
            files.append(path)
        else:
            raise DataError(f"no such file or directory: {p}")
    documents: List[str] = []
    for f in files:
        try:
            documents.extend([f.read_text(encoding="utf-8")] if f.suffix == ".txt" else _jsonl_documents(f, json_key))
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror or e}") from None
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise DataError(f"no non-empty document in {' '.join(paths)}")
    return Corpus(tuple(documents), f"{len(files)} file(s) from {' '.join(paths)}")


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg}): write one object per line, like "
                                f'{{"{key}": "..."}}') from None
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                raise DataError(f"{path}:{n}: no string field {key!r}: name the text field with --json-key")
            yield obj[key]


# --- The split, with megatron-core's rounding -------------------------------------------------

def split_weights(split: str) -> List[float]:
    """``"90,10,0"`` -> normalised train/validation/test weights (missing parts are 0)."""
    try:
        values = [float(p) for p in split.split(",")]
    except ValueError:
        values = [-1.0]  # refused below, with the message that names the fix
    if len(values) > len(SPLIT_NAMES) or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(f"--split {split!r}: give up to three non-negative weights for train, validation "
                        f"and test, not all zero, like 90,10,0")
    total = sum(values)
    return [v / total for v in values + [0.0] * (len(SPLIT_NAMES) - len(values))]


def documents_per_split(split: str, documents: int) -> List[Optional[int]]:
    """Documents each split gets from megatron-core, None for a split of weight 0: cumulative
    weights (``convert_split_vector_to_split_matrix``), then ``int(round(bound * documents))``."""
    bounds = list(accumulate(split_weights(split), initial=0.0))
    return [None if hi <= lo else int(round(hi * documents)) - int(round(lo * documents))
            for lo, hi in zip(bounds, bounds[1:])]


def suggest_split(split: str, documents: int) -> Optional[str]:
    """A split in document counts in the weights' proportions, >= 1 for each of positive weight (or None)."""
    weights = split_weights(split)
    counts = [max(1, int(w * documents)) if w > 0 else 0 for w in weights]
    biggest = max(range(len(counts)), key=lambda i: weights[i])
    counts[biggest] -= sum(counts) - documents
    if any(w > 0 and c < 1 for w, c in zip(weights, counts)):
        return None
    text = ",".join(str(c) for c in counts)
    ok = all(n is None or n >= 1 for n in documents_per_split(text, documents))
    return text if ok else None


def split_counts(counts: Sequence[Optional[int]]) -> str:
    """``train 71, validation 8, test -`` (``-``: a split of weight 0)."""
    return ", ".join(f"{name} {'-' if n is None else n}" for name, n in zip(SPLIT_NAMES, counts))


def check_split(split: str, documents: int) -> List[Optional[int]]:
    """The documents per split, or :class:`DataError` if a split of positive weight gets none."""
    counts = documents_per_split(split, documents)
    empty = [name for name, n in zip(SPLIT_NAMES, counts) if n == 0]
    if not empty:
        return counts
    better = suggest_split(split, documents)
    fix = (f"use --split {better} (document counts work as weights)" if better else
           "add documents (each split of positive weight needs at least one)")
    zero = ",".join("0" if name in empty else p for name, p in
                    zip(SPLIT_NAMES, (split.split(",") + ["0"] * 3)[:3]))
    raise DataError(f"--split {split} on {documents} documents leaves the {' and '.join(empty)} split "
                    f"empty ({split_counts(counts)}) and Megatron's GPTDataset then loops forever in _get_num_epochs: "
                    f"{fix}, or give the {' and '.join(empty)} split weight 0 (--split {zero})")


def train_tokenizer(documents: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) with :data:`EOD_TOKEN` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def tokenizer_file(path: str) -> Path:
    """``path/tokenizer.json`` for a directory, ``path`` for a file; :class:`DataError` if absent."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise DataError(f"--tokenizer {path}: no tokenizer.json there: give a HuggingFace tokenizer directory "
                        f"(holding tokenizer.json) or the tokenizer.json file")
    return f


def load_tokenizer(path: str, eod_token: Optional[str]):
    """(tokenizer, end-of-document token) of a tokenizer directory or file: ``eod_token``, else the
    ``eos_token`` of its ``tokenizer_config.json``, else the first of :data:`KNOWN_EOD_TOKENS` it has."""
    from tokenizers import Tokenizer

    f = tokenizer_file(path)
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        raise DataError(f"--tokenizer {path}: cannot load {f} ({e})") from None
    candidates = [eod_token] if eod_token else [_configured_eos(f.parent / "tokenizer_config.json"),
                                                *KNOWN_EOD_TOKENS]
    for token in candidates:
        if token and tok.token_to_id(token) is not None:
            return tok, token
    if eod_token:
        raise DataError(f"--eod-token {eod_token!r} is not in the vocabulary of {f}")
    raise DataError(f"{f} names no end-of-document token: give one with --eod-token")


def _configured_eos(config: Path) -> Optional[str]:
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def save_tokenizer(tok, eod_token: str, directory: Path) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` with which Megatron-LM's
    ``HuggingFaceTokenizer`` (``AutoTokenizer.from_pretrained``) loads the directory offline."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token, "bos_token": eod_token,
              "model_max_length": 1_000_000_000, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class PreparedData:
    """An indexed dataset and the tokenizer its tokens come from."""

    prefix: str           # the ``--data-path`` value: the .bin/.idx path without its suffix
    tokenizer_dir: str    # the ``--tokenizer-model`` value
    documents: int
    tokens: int
    vocab_size: int
    eod: int
    eod_token: str
    source: str
    cached: bool = False

    def megatron_args(self, split: str) -> List[str]:
        """The data and tokenizer arguments for Megatron-LM's ``pretrain_gpt.py``."""
        return ["--data-path", self.prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", self.tokenizer_dir, "--split", split]

    @classmethod
    def load(cls, directory: str) -> "PreparedData":
        """The entry :func:`prepare` wrote in ``directory``; :class:`DataError` if there is none."""
        try:
            fields = json.loads(Path(directory, MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise DataError(f"{directory} holds no data prepared by megatron-dualpipe prepare-data") from None
        keep = {k: fields[k] for k in ("documents", "tokens", "vocab_size", "eod", "eod_token", "source")}
        return cls(prefix=os.path.join(directory, PREFIX_NAME), tokenizer_dir=os.path.join(directory, TOKENIZER_DIR),
                   cached=True, **keep)


def describe_indexed(prefix: str, tokenizer: Optional[str], eod_token: Optional[str]) -> PreparedData:
    """A user's indexed dataset (``prefix.bin/.idx``) with its tokenizer, or an entry :func:`prepare` wrote."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if os.path.basename(prefix) == PREFIX_NAME and os.path.isfile(os.path.join(directory, MANIFEST)) \
            and tokenizer is None:
        return PreparedData.load(directory)
    missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
    if missing:
        raise DataError(f"--data-path {prefix}: no {' or '.join(missing)}: give the prefix of a Megatron indexed "
                        f"dataset (the path without .bin/.idx), or use --text to prepare one")
    if tokenizer is None:
        raise DataError(f"--data-path {prefix}: also give --tokenizer DIR, the HuggingFace tokenizer "
                        f"its tokens come from")
    tok, eod_name = load_tokenizer(tokenizer, eod_token)
    from .quiet import silence_known_warnings

    silence_known_warnings()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(prefix)
    return PreparedData(prefix=prefix, tokenizer_dir=str(tokenizer_file(tokenizer).parent),
                        documents=len(index.document_indices) - 1, tokens=int(index.sequence_lengths.sum()),
                        vocab_size=tok.get_vocab_size(), eod=tok.token_to_id(eod_name), eod_token=eod_name,
                        source=f"indexed dataset {prefix}", cached=True)


def default_cache_dir() -> str:
    """``$MEGATRON_DUALPIPE_CACHE``, else ``megatron-dualpipe`` in the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("MEGATRON_DUALPIPE_CACHE") or os.path.join(base, "megatron-dualpipe")


def cache_key(corpus: Corpus, tokenizer_json: Optional[bytes], vocab_size: int, eod_token: Optional[str]) -> str:
    """Hash of what the output depends on: documents, tokenizer (file or settings), output format."""
    h = hashlib.sha256()
    settings = {"format": FORMAT_VERSION, "eod_token": eod_token,
                "tokenizer": hashlib.sha256(tokenizer_json).hexdigest() if tokenizer_json is not None
                else {"train": "byte-level-bpe", "vocab_size": vocab_size}}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for doc in corpus.documents:
        b = doc.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:20]


def prepare(corpus: Corpus, cache_dir: str, tokenizer: Optional[str], vocab_size: int, eod_token: Optional[str],
            progress: Progress) -> PreparedData:
    """Tokenize ``corpus`` and write Megatron's indexed dataset, or return the cached entry."""
    given = tokenizer_file(tokenizer).read_bytes() if tokenizer else None
    if given is None and vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
                        f"(256 bytes and the end-of-document token)")
    final = Path(cache_dir, "data", cache_key(corpus, given, vocab_size, eod_token))
    if (final / MANIFEST).is_file():
        data = PreparedData.load(str(final))
        progress.say(f"cache hit: {data.documents} documents, {data.tokens:,} tokens, vocabulary "
                     f"{data.vocab_size} in {final}")
        return data
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    except OSError as e:
        raise DataError(f"cannot write the data cache in {cache_dir} ({e.strerror or e}): choose another "
                        f"with --cache-dir or MEGATRON_DUALPIPE_CACHE") from None
    try:
        _build(corpus, work, tokenizer, vocab_size, eod_token, progress)
        try:
            os.rename(work, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)  # left only by a failed or a concurrent run
    progress.say(f"wrote {final}")
    return dataclasses.replace(PreparedData.load(str(final)), cached=False)


def _build(corpus: Corpus, work: Path, tokenizer: Optional[str], vocab_size: int,
           eod_token: Optional[str], progress: Progress) -> None:
    t0 = time.perf_counter()
    if tokenizer:
        tok, eod_name = load_tokenizer(tokenizer, eod_token)
        progress.say(f"tokenizer {tokenizer_file(tokenizer)}: vocabulary {tok.get_vocab_size()}, "
                     f"end of document {eod_name!r}")
    else:
        tok, eod_name = train_tokenizer(corpus.documents, vocab_size), EOD_TOKEN
        progress.say(f"trained a byte-level BPE tokenizer, vocabulary {tok.get_vocab_size()} "
                     f"({time.perf_counter() - t0:.1f} s)")
    save_tokenizer(tok, eod_name, work / TOKENIZER_DIR)
    eod, vocab = tok.token_to_id(eod_name), tok.get_vocab_size()

    t0 = time.perf_counter()
    documents = tokenize(tok, corpus.documents, eod, progress)
    tokens = sum(len(d) for d in documents)
    progress.say(f"tokenized {len(documents)} documents: {tokens:,} tokens ({time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    write_indexed_dataset(str(work / PREFIX_NAME), documents, vocab)
    progress.say(f"wrote {PREFIX_NAME}.bin/.idx with megatron-core's IndexedDatasetBuilder "
                 f"({time.perf_counter() - t0:.1f} s)")
    manifest = {"format": FORMAT_VERSION, "documents": len(documents), "tokens": tokens, "vocab_size": vocab,
                "eod": eod, "eod_token": eod_name, "source": corpus.source, "characters": corpus.characters}
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def tokenize(tok, documents: Sequence[str], eod: int, progress: Progress) -> List[List[int]]:
    """Token ids of each document followed by ``eod``, in batches so progress can be shown."""
    out: List[List[int]] = []
    batch = max(1, min(256, len(documents) // 20))
    progress.phase("tokenizing documents")
    for i in range(0, len(documents), batch):
        out.extend(enc.ids + [eod] for enc in tok.encode_batch(list(documents[i:i + batch]), add_special_tokens=False))
        progress.update(len(out), len(documents))
    return out


def write_indexed_dataset(prefix: str, documents: Sequence[Sequence[int]], vocab_size: int) -> None:
    """``prefix.bin``/``.idx``: one document per entry, in the smallest dtype that holds the vocabulary."""
    import numpy

    from .quiet import silence_known_warnings

    silence_known_warnings()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in documents:
        builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
    builder.finalize(prefix + ".idx")


def add_data_arguments(p: argparse.ArgumentParser, text_flag: Optional[str] = None) -> None:
    """The data options of ``prepare-data`` and the main job (TEXT positional unless ``text_flag``)."""
    help_text = ("directories, .txt files (one document each) or .jsonl files (one per line); "
                 "default: Python's own help texts")
    if text_flag:
        p.add_argument(text_flag, nargs="+", metavar="PATH", dest="text", default=[], help=help_text)
    else:
        p.add_argument("text", nargs="*", metavar="TEXT", help=help_text)
    p.add_argument("--tokenizer", metavar="DIR", help="use this HuggingFace tokenizer (a directory with "
                   "tokenizer.json, or the file) instead of training one")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, metavar="N",
                   help=f"vocabulary of the trained tokenizer (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--eod-token", metavar="TOKEN", help="end-of-document token of a given tokenizer")
    p.add_argument("--json-key", default="text", metavar="KEY", help="text field of .jsonl lines (default text)")
    p.add_argument("--split", default=DEFAULT_SPLIT, metavar="W,W,W",
                   help=f"train,validation,test weights, checked against the documents (default {DEFAULT_SPLIT})")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where prepared data is kept (default $MEGATRON_DUALPIPE_CACHE or ~/.cache/megatron-dualpipe)")


def prepare_from_args(args: argparse.Namespace, progress: Progress) -> Tuple[PreparedData, List[Optional[int]]]:
    """Read, check the split, prepare: what both ``prepare-data`` and the main job do."""
    corpus = read_corpus(args.text, args.json_key)
    progress.say(f"{len(corpus.documents)} documents, {corpus.characters:,} characters: {corpus.source}")
    counts = check_split(args.split, len(corpus.documents))
    data = prepare(corpus, args.cache_dir or default_cache_dir(), args.tokenizer, args.vocab_size,
                   args.eod_token, progress)
    progress.say(f"split {args.split}: {split_counts(counts)} documents")
    return data, counts
