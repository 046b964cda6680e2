"""The packaged demo corpus, a character vocabulary and a windowed dataset."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from elastictrain.demo.windows import load_corpus_text, window_count


class CharVocab:
    """Bijection between the characters of a text and contiguous integer ids.

    Ids follow sorted character order, so the mapping depends only on the set of
    characters and is identical on every rank.
    """

    def __init__(self, text: str) -> None:
        """Build the vocabulary from every distinct character in ``text``."""
        self.chars: list[str] = sorted(set(text))
        self._stoi = {ch: i for i, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Map ``text`` to ids; raises ``KeyError`` on unknown characters."""
        return [self._stoi[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        """Map ``ids`` back to text."""
        return "".join(self.chars[i] for i in ids)


class CharDataset(Dataset[tuple[Tensor, Tensor]]):
    """Fixed-length (input, next-token target) windows over an encoded text.

    Item ``i`` starts at offset ``i * stride``; the target is the input shifted
    by one position.
    """

    def __init__(self, data: Tensor, block_size: int, stride: int | None = None) -> None:
        """Create the dataset.

        Args:
            data: 1-D ``torch.long`` tensor of token ids.
            block_size: Window length.
            stride: Offset between consecutive windows; defaults to
                ``block_size`` (non-overlapping windows).
        """
        if data.dim() != 1:
            raise ValueError("data must be a 1-D tensor")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.data = data.long()
        self.block_size = block_size
        self.stride = block_size if stride is None else stride
        if self.stride < 1:
            raise ValueError("stride must be positive")

    def __len__(self) -> int:
        return window_count(self.data.numel(), self.block_size, self.stride)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def encode_tensor(vocab: CharVocab, text: str) -> Tensor:
    """Encode ``text`` with ``vocab`` into a 1-D ``torch.long`` tensor."""
    return torch.tensor(vocab.encode(text), dtype=torch.long)


def demo_corpus(block_size: int) -> tuple[CharVocab, CharDataset]:
    """The packaged corpus as a vocabulary and its windowed dataset."""
    text = load_corpus_text()
    vocab = CharVocab(text)
    return vocab, CharDataset(encode_tensor(vocab, text), block_size)


class IndexedPrefix(Dataset[tuple[int, Tensor, Tensor]]):
    """The first ``length`` items of a dataset, each returned with its index, so a
    training step can record exactly which samples it trained."""

    def __init__(self, dataset: CharDataset, length: int | None = None) -> None:
        full = len(dataset)
        self.dataset = dataset
        self.length = full if length is None else length
        if not 1 <= self.length <= full:
            raise ValueError(f"length={self.length} must be in 1..{full}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[int, Tensor, Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        x, y = self.dataset[i]
        return i, x, y
