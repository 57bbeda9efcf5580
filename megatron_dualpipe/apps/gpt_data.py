"""The main job's batches: megatron-core's ``GPTDataset``, built as ``pretrain_gpt.py`` builds it
(collective: every rank calls :func:`build_datasets`). Micro-batch ``g`` of iteration ``it`` reads
the samples from ``(it*M + g) * b`` on, so every schedule reads the same micro-batches.
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
    """A HuggingFace ``tokenizers`` tokenizer in the interface megatron-core's datasets read; needs no
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


def micro_batch(dataset: GPTDataset, first_sample: int, micro_batch_size: int) -> Dict[str, torch.Tensor]:
    """``micro_batch_size`` consecutive samples from ``first_sample``, each field stacked."""
    rows = [dataset[first_sample + r] for r in range(micro_batch_size)]
    return {k: torch.stack([row[k] for row in rows]) for k in BATCH_KEYS}
