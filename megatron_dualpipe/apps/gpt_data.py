"""The main job's batches: megatron-core's ``GPTDataset`` over a prepared indexed dataset.

Built exactly as Megatron-LM's ``pretrain_gpt.py`` builds it: a ``GPTDatasetConfig`` with one
``--data-path`` prefix and a ``--split``, handed to ``BlendedMegatronDatasetBuilder``; the
returned train and validation ``GPTDataset``s shuffle documents, concatenate them (with their
end-of-document tokens) and cut samples of ``seq_length + 1`` tokens. The builder is collective
(rank 0 writes the shuffle indices, then a barrier), so every rank calls :func:`build_datasets`.

Samples are addressed by a global index: iteration ``it`` of a run with M micro-batches of b
samples reads samples ``[it*M*b, (it+1)*M*b)``, micro-batch ``g`` the ``g``-th block of b. Both
schedules therefore read the same samples in the same micro-batches, whatever order they run
them in.

Only the main job's workers import it, after :func:`.quiet.silence_known_warnings` (megatron-core's
import warns without Transformer Engine or Apex).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers import MegatronTokenizerBase

from .data_prep import PreparedData, tokenizer_file

#: The fields of a GPTDataset sample a training step uses.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class TextTokenizer(MegatronTokenizerBase):
    """A HuggingFace ``tokenizers`` tokenizer in the interface megatron-core's datasets read
    (``vocab_size``, ``eod``, ``unique_identifiers`` for the index cache). Needs no
    ``transformers``: the data is already tokenized, only the ids are looked up."""

    def __init__(self, data: PreparedData):
        from tokenizers import Tokenizer

        path = str(tokenizer_file(data.tokenizer_dir))
        super().__init__(path, {})
        self._tok = Tokenizer.from_file(path)
        self._eod = data.eod

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        return OrderedDict(**{"class": type(self).__name__, "tokenizer_path": self.path, "eod": str(self._eod)})

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("a pretraining tokenizer has no chat template")


def build_datasets(data: PreparedData, seq_length: int, split: str, train_samples: int, valid_samples: int,
                   seed: int, cache_dir: str) -> Tuple[GPTDataset, Optional[GPTDataset]]:
    """(train, validation) ``GPTDataset``s of at least the given sizes; validation is None when
    the split gives it weight 0. ``cache_dir`` holds megatron-core's shuffle-index files."""
    os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([data.prefix], None), split=split,
        path_to_cache=cache_dir, tokenizer=TextTokenizer(data), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    train, valid, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config).build()
    return train, valid


def micro_batches(dataset: GPTDataset, first_sample: int, count: int, micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``micro_batch_size`` consecutive samples from ``first_sample``:
    tokens, labels, loss_mask, position_ids, each ``[micro_batch_size, seq_length]``."""
    out = []
    for g in range(count):
        start = first_sample + g * micro_batch_size
        rows = [dataset[start + r] for r in range(micro_batch_size)]
        out.append({k: torch.stack([row[k] for row in rows]) for k in BATCH_KEYS})
    return out
