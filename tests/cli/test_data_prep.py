"""``megatron-dualpipe prepare-data`` on a tiny corpus, read back through megatron-core.

The reference for the written data is computed here independently: each input document encoded
by the saved ``tokenizer.json`` (loaded afresh with ``tokenizers``) plus the end-of-document id.
megatron-core's own ``IndexedDataset`` must return exactly those documents, in input order.
The split arithmetic is compared with megatron-core's ``parse_and_normalize_split`` /
``convert_split_vector_to_split_matrix`` and the rounding of ``BlendedMegatronDatasetBuilder``.
"""
import json
import os
import pathlib
import shlex

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.apps.data_prep import (DataError, check_split, documents_per_split, python_help_texts,
                                         suggest_split)

DOCS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Pipeline parallelism splits a model into stages; micro-batches flow through them.",
    "DualPipe feeds micro-batches from both ends of the pipeline at once.",
    "Zero bubble: the weight gradient is computed later, filling idle time.",
    "Ünïcödé and emoji 🚀 survive byte-level BPE.",
    "A document that is long enough to need several tokens, repeated: " + "la " * 40,
]


def write_corpus(root: pathlib.Path) -> list:
    """Two .txt files and a .jsonl file in a directory; returns the documents in reading order
    (files sorted by path, jsonl lines in order, blank documents dropped)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS[1:5] + ["  "]) + "\n",
                                  encoding="utf-8")
    (root / "c.txt").write_text(DOCS[5], encoding="utf-8")
    return [DOCS[0]] + DOCS[1:5] + [DOCS[5]]


def run(capsys, *argv):
    """Run the command in-process; show its stderr (progress, errors) in pytest -s output."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    with capsys.disabled():
        print(err, end="")
    return code, out, err


def prepared(out: str) -> dict:
    argv = shlex.split(out.strip())
    return {argv[i]: argv[i + 1] for i in range(0, len(argv), 2)}


def test_written_documents_equal_the_input_and_rerun_is_a_cache_hit(capsys, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    docs = write_corpus(tmp_path / "text")
    cache = tmp_path / "cache"
    code, out, err = run(capsys, "prepare-data", str(tmp_path / "text"), "--vocab-size", "300", "--split", "4,1,1",
                         "--cache-dir", str(cache))
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1  # stdout: only the arguments
    args = prepared(out)
    assert args["--tokenizer-type"] == "HuggingFaceTokenizer" and args["--split"] == "4,1,1"
    prefix, tok_dir = args["--data-path"], args["--tokenizer-model"]

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    expected = [tok.encode(d, add_special_tokens=False).ids + [eod] for d in docs]
    index = IndexedDataset(prefix)
    got = [index[i].tolist() for i in range(len(index))]
    with capsys.disabled():
        print(f"read back: {len(got)} documents, {sum(map(len, got))} tokens, vocabulary {tok.get_vocab_size()}, "
              f"eod {eod}")
    assert len(index.document_indices) - 1 == len(docs)
    assert got == expected
    assert [tok.decode(ids[:-1]) for ids in got] == docs  # byte-level BPE round-trips the text
    assert "train 4, validation 1, test 1 documents" in err

    bin_mtime = os.path.getmtime(prefix + ".bin")
    code, out2, err2 = run(capsys, "prepare-data", str(tmp_path / "text"), "--vocab-size", "300", "--split", "4,1,1",
                           "--cache-dir", str(cache))
    assert code == 0 and out2.splitlines()[-1] == out.strip() and "cache hit" in err2
    assert os.path.getmtime(prefix + ".bin") == bin_mtime
    assert len(list((cache / "data").iterdir())) == 1  # no temporary directory left behind

    # A different vocabulary is different content: a new entry.
    code, out3, _ = run(capsys, "prepare-data", str(tmp_path / "text"), "--vocab-size", "301", "--split", "4,1,1",
                        "--cache-dir", str(cache))
    assert code == 0 and prepared(out3)["--data-path"] != prefix

    # The saved tokenizer, given back, gives the same data.
    code, out4, err4 = run(capsys, "prepare-data", str(tmp_path / "text"), "--tokenizer", tok_dir,
                           "--split", "4,1,1", "--cache-dir", str(cache))
    assert code == 0, err4
    again = IndexedDataset(prepared(out4)["--data-path"])
    assert [again[i].tolist() for i in range(len(again))] == expected


def test_tokenizer_directory_loads_offline_with_transformers(capsys, tmp_path, monkeypatch):
    """What Megatron-LM's --tokenizer-type HuggingFaceTokenizer does with --tokenizer-model DIR."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = write_corpus(tmp_path / "text")
    code, out, err = run(capsys, "prepare-data", str(tmp_path / "text"), "--vocab-size", "300", "--split", "1",
                         "--cache-dir", str(tmp_path / "cache"))
    assert code == 0, err
    tok_dir = prepared(out)["--tokenizer-model"]
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    with capsys.disabled():
            print(f"transformers {transformers.__version__}: {type(hf).__name__}, vocabulary {len(hf)}, eos {hf.eos_token_id}")
    assert len(hf) == raw.get_vocab_size()
    assert hf.eos_token_id == raw.token_to_id("<|endoftext|>")
    for d in docs:
        assert hf(d).input_ids == raw.encode(d, add_special_tokens=False).ids


def test_split_that_empties_a_split_is_refused_before_any_work(capsys, tmp_path):
    write_corpus(tmp_path / "text")
    cache = tmp_path / "cache"
    code, out, err = run(capsys, "prepare-data", str(tmp_path / "text"), "--split", "949,50,1",
                         "--cache-dir", str(cache))
    assert code == 2 and out == ""
    error = [line for line in err.splitlines() if line.startswith("megatron-dualpipe: error:")]
    assert len(error) == 1 and "Traceback" not in err
    assert "leaves the validation and test split empty" in error[0] and "_get_num_epochs" in error[0]
    assert "--split 4,1,1" in error[0] and "--split 949,0,0" in error[0]
    assert not cache.exists()
    assert check_split("4,1,1", 6) == [4, 1, 1]


def test_the_default_split_fits_python_help_texts():
    """The default corpus with Megatron's default split would hang; ours does not."""
    n = len(python_help_texts().documents)
    print(f"Python's help texts: {n} documents; 969,30,1 -> {documents_per_split('969,30,1', n)}")
    assert n > 20
    with pytest.raises(DataError, match="test split empty"):
        check_split("969, 30, 1", n)
    assert all(c is None or c > 0 for c in check_split("90,10,0", n))


@pytest.mark.parametrize("split", ["949,50,1", "969, 30, 1", "90,10,0", "1", "98,2", "0,1,0", "33,33,34", "1,0,1"])
@pytest.mark.parametrize("n", [1, 3, 7, 79, 1000])
def test_documents_per_split_equals_megatron_core(split, n):
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    expected = [None if b is None else int(round(b[1] * float(n))) - int(round(b[0] * float(n))) for b in matrix]
    assert documents_per_split(split, n) == expected
    better = suggest_split(split, n)
    if better is not None:
        assert all(c is None or c >= 1 for c in documents_per_split(better, n)), better


BAD = [
    (["/no/such/dir"], "no such file or directory"),
    (["--vocab-size", "100"], "at least 257"),
    (["--split", "a,b"], "non-negative weights"),
    (["--split", "0,0,0"], "not all zero"),
    (["--split", "1,1,1,1"], "up to three"),
    (["--tokenizer", "/no/such/tokenizer"], "no tokenizer.json"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_bad_input_gives_one_line(capsys, tmp_path, extra, needle):
    write_corpus(tmp_path / "text")
    text = [] if extra[0].startswith("/") else [str(tmp_path / "text")]
    code, out, err = run(capsys, "prepare-data", *text, *extra, "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].startswith("megatron-dualpipe: error: ") and needle in err.splitlines()[-1]


def test_bad_jsonl_names_the_line(capsys, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    code, _, err = run(capsys, "prepare-data", str(tmp_path / "bad.jsonl"), "--cache-dir", str(tmp_path / "c"))
    assert code == 2 and "bad.jsonl:2" in err and "--json-key" in err
