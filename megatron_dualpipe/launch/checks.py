"""What ``pretrain_gpt.py`` would fail on after ``torchrun`` started, checked in a second before it
starts: Megatron-LM meets a missing tokenizer file as a bare ``assert`` in every rank 20 s in, token
ids past the vocabulary as an ``IndexError`` 40 s in. Standard library, plus numpy and ``tokenizers``
where installed.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
from typing import Collection, Dict, List, Optional, Sequence, Tuple

#: Bytes of each ``.bin`` scanned for its largest token id (the whole file when smaller).
SCAN_BYTES = 1 << 30
#: Megatron's indexed dataset: ``.idx`` header magic and its dtype codes.
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}

#: tokenizer type -> (arguments it needs, what they are), from Megatron-LM's ``build_tokenizer``.
TOKENIZER_NEEDS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    **dict.fromkeys(("BertWordPieceLowerCase", "BertWordPieceCase"), (("--vocab-file",), "a BERT vocab.txt")),
    "GPT2BPETokenizer": (("--vocab-file", "--merge-file"), "GPT-2's vocab.json and merges.txt"),
    **dict.fromkeys(("SentencePieceTokenizer", "GPTSentencePieceTokenizer"),
                    (("--tokenizer-model",), "a SentencePiece .model file")),
    "Llama2Tokenizer": (("--tokenizer-model",), "Llama 2's tokenizer.model"),
    "TikTokenizer": (("--tokenizer-model",), "a tiktoken JSON file"),
    **dict.fromkeys(("HuggingFaceTokenizer", "MultimodalTokenizer", "SFTTokenizer"),
                    (("--tokenizer-model",), "a HuggingFace tokenizer directory or hub name")),
    **dict.fromkeys(("NullTokenizer", "NullMultimodalTokenizer"), (("--vocab-size",), "the vocabulary size")),
}
#: Arguments that take one value / several values (to read argv without Megatron's parser).
_ONE = ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model", "--vocab-size")
_MANY = ("--data-path",)

EXAMPLE = ("e.g. --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (megatron-dualpipe prepare-data "
           "writes one with the data), or GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt")


def flag_values(argv: Sequence[str], flags: Collection[str]) -> List[Tuple[str, str]]:
    """(flag, value) of each of ``flags`` in ``argv``, in order: ``--flag=value`` or ``--flag value`` ('' last)."""
    return [(flag, val if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
            for i, (flag, eq, val) in enumerate(a.partition("=") for a in argv) if flag in flags]


def parse(argv: Sequence[str]) -> Dict[str, object]:
    """The values of the options this check reads (the last one wins, as with argparse)."""
    args = list(argv)
    found: Dict[str, object] = dict(flag_values(args, _ONE))
    for i, (flag, eq, val) in enumerate(a.partition("=") for a in args):
        if flag in _MANY:
            found[flag] = [val] if eq else list(itertools.takewhile(lambda v: not v.startswith("--"), args[i + 1:]))
    if "--mock-data" in args:
        found["--mock-data"] = True
    return found


# torch

def torch_problem() -> Optional[str]:
    """Why this interpreter cannot run ``torchrun``, or None (files only: importing torch takes seconds)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    fix = (f"install it there ({sys.executable} -m pip install torch; this checkout: bash scripts/setup_venv.sh), "
           f"or set PYTHON (or TORCHRUN) to the training environment's")
    if spec is None or not spec.submodule_search_locations:
        return f"{sys.executable} cannot import torch: {fix}"
    if not any(os.path.isfile(os.path.join(d, "distributed", "run.py")) for d in spec.submodule_search_locations):
        return f"{sys.executable}'s torch has no torch.distributed.run (torchrun): {fix}"
    return None


# Tokenizer

def _vocab_of_file(kind: str, path: str) -> Tuple[Optional[str], Optional[int]]:
    """(problem, vocabulary size) of GPT-2's vocab.json or a BERT vocab.txt (one token a line)."""
    try:
        with open(path, encoding="utf-8") as fh:
            if kind != "GPT2BPETokenizer":
                return None, sum(1 for line in fh if line.strip())
            vocab = json.load(fh)
        if not isinstance(vocab, dict):
            return f"--vocab-file {path} is not GPT-2's vocab.json (a JSON object of token -> id)", None
        return None, max(vocab.values(), default=-1) + 1
    except (OSError, ValueError, UnicodeDecodeError, TypeError) as e:
        return f"--vocab-file {path} cannot be read as {kind}'s vocabulary: {e}", None


#: Files of which a HuggingFace tokenizer directory has at least one (fast, BPE, WordPiece, SentencePiece, tiktoken).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                      "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def _hf_directory_problem(path: str) -> Optional[str]:
    """Why the directory ``path`` holds no HuggingFace tokenizer (transformers would fail in every rank), or None."""
    try:
        names = os.listdir(path)
    except OSError as e:
        return f"--tokenizer-model {path} cannot be read: {e}"
    if any(n in HF_TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names):
        return None
    what = "is an empty directory" if not names else f"holds none of {', '.join(HF_TOKENIZER_FILES[:5])}, ..."
    return (f"--tokenizer-model {path} {what}: give the tokenizer directory (megatron-dualpipe prepare-data "
            f"writes one beside the data, DIR/tokenizer)")


def _vocab_of_hf(path: str) -> Tuple[Optional[str], Optional[int]]:
    """(problem, vocabulary size) of a HuggingFace tokenizer directory (its tokenizer.json)."""
    if os.path.isdir(path) and (problem := _hf_directory_problem(path)):
        return problem, None
    f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        return None, None  # a slow tokenizer (vocab files only): transformers loads it, we cannot cheaply
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, None
    try:
        return None, Tokenizer.from_file(f).get_vocab_size()
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
        return f"--tokenizer-model {path}: {f} does not load: {str(e).splitlines()[0][:200]}", None


def tokenizer_problem(opts: Dict[str, object]) -> Tuple[Optional[str], Optional[int]]:
    """(problem naming the fix, or None; the tokenizer's vocabulary size where known)."""
    kind = opts.get("--tokenizer-type")
    if not kind:
        return f"no --tokenizer-type: Megatron-LM needs one to read the data; pass it, {EXAMPLE}", None
    if kind not in TOKENIZER_NEEDS:
        return f"--tokenizer-type {kind} is not one of Megatron-LM's: {', '.join(TOKENIZER_NEEDS)}", None
    needs, what = TOKENIZER_NEEDS[kind]
    missing = [flag for flag in needs if not opts.get(flag)]
    if missing:
        return (f"--tokenizer-type {kind} needs {' and '.join(missing)} ({what}): pass "
                f"{' '.join(f'{m} PATH' if m != '--vocab-size' else f'{m} N' for m in missing)}, or another "
                f"tokenizer, {EXAMPLE}"), None
    if kind.startswith("Null"):
        try:
            return None, int(str(opts["--vocab-size"]))
        except ValueError:
            return f"--vocab-size must be an integer, got {opts['--vocab-size']}", None
    hub = "hub name" in what
    for flag in needs:
        path = str(opts[flag])
        # A HuggingFace hub name ("org/name") is not a path; a relative or absolute path must exist.
        if not os.path.exists(path) and not (hub and not path.startswith(("/", ".", "~"))):
            return f"{flag} {path}: no such file or directory: give the path to {what}", None
    if kind == "GPT2BPETokenizer" or kind.startswith("BertWordPiece"):
        return _vocab_of_file(kind, str(opts["--vocab-file"]))
    if kind == "HuggingFaceTokenizer" and os.path.exists(str(opts["--tokenizer-model"])):
        return _vocab_of_hf(str(opts["--tokenizer-model"]))
    return None, None


# Data

def data_prefixes(opts: Dict[str, object]) -> List[str]:
    """The prefixes of ``--data-path`` (a prefix, or a blend ``weight prefix weight prefix ...``)."""
    words = list(opts.get("--data-path") or [])
    def number(w):
        try:
            float(w)
            return True
        except ValueError:
            return False
    return [w for w in words if not number(w)]


def largest_token_id(prefix: str, scan_bytes: int = SCAN_BYTES) -> Optional[int]:
    """The largest token id in the first ``scan_bytes`` of ``prefix.bin``, or None (no numpy, not Megatron's)."""
    try:
        import numpy as np
    except ImportError:
        return None
    with open(prefix + ".idx", "rb") as fh:
        head = fh.read(len(IDX_MAGIC) + 8 + 1)
    if head[:len(IDX_MAGIC)] != IDX_MAGIC or len(head) < len(IDX_MAGIC) + 9:
        return None
    dtype = np.dtype(IDX_DTYPES.get(head[-1], "int32"))
    size = os.path.getsize(prefix + ".bin")
    count = min(size, scan_bytes) // dtype.itemsize
    if count == 0:
        return None
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(count,))
    return int(tokens.max())


def _prepared_tokenizer(prefix: str) -> str:
    """Where prepare-data left the tokenizer of ``prefix`` (a hint for the fix), or ''."""
    d = os.path.dirname(os.path.abspath(prefix))
    tok = os.path.join(d, "tokenizer")
    if os.path.isfile(os.path.join(d, "manifest.json")) and os.path.isdir(tok):
        return f" (prepare-data wrote it with its tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tok})"
    return ""


def _files_problem(prefix: str) -> Optional[str]:
    """Why ``prefix.bin`` / ``.idx`` are not an indexed dataset Megatron can read, or None."""
    fix = "give the prefix that tools/preprocess_data.py or megatron-dualpipe prepare-data wrote, without .bin/.idx"
    missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
    if missing:
        return f"--data-path {prefix}: no {' or '.join(missing)}: {fix}"
    empty = [prefix + s for s in (".bin", ".idx") if os.path.getsize(prefix + s) == 0]
    if empty:
        return f"--data-path {prefix}: {' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty (0 bytes): " \
               f"the preprocessing did not finish; run it again, or {fix}"
    try:
        with open(prefix + ".idx", "rb") as fh:
            head = fh.read(len(IDX_MAGIC))
    except OSError as e:
        return f"--data-path {prefix}: cannot read {prefix}.idx: {e}"
    if head != IDX_MAGIC:
        return f"--data-path {prefix}: {prefix}.idx is not a Megatron indexed-dataset index (no MMIDIDX header): {fix}"
    return None


def data_problem(opts: Dict[str, object], vocab: Optional[int], scan: bool = True) -> Optional[str]:
    if opts.get("--mock-data"):
        return None
    prefixes = data_prefixes(opts)
    if not prefixes:
        return ("no --data-path: pass the prefix that Megatron-LM's tools/preprocess_data.py or megatron-dualpipe "
                "prepare-data wrote (the path without .bin/.idx), or --mock-data")
    for p in prefixes:
        if problem := _files_problem(p):
            return problem
    if vocab is None or not scan:
        return None
    for p in prefixes:
        try:
            top = largest_token_id(p)
        except (OSError, ValueError) as e:
            return f"--data-path {p}: cannot read its tokens: {e}"
        if top is not None and top >= vocab:
            return (f"--data-path {p} holds token id {top} but the tokenizer has only {vocab} entries, so the "
                    f"embedding would fail with an IndexError: pass the tokenizer the data was tokenized with"
                    f"{_prepared_tokenizer(p)}")
    return None


def argument_problems(argv: Sequence[str], scan: bool = True) -> List[str]:
    """The problems of ``pretrain_gpt.py ARGV``'s tokenizer and data, one line each."""
    opts = parse(argv)
    tok, vocab = tokenizer_problem(opts)
    return [p for p in (tok, data_problem(opts, vocab, scan=scan)) if p]
