"""Tests for the demo corpus generator, corpus helpers and the tiny GPT."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from elastictrain.demo.corpus import CharDataset, CharVocab, encode_tensor
from elastictrain.demo.model import CharGPT, GPTConfig
from elastictrain.demo.windows import load_corpus_text
from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "make_demo_corpus.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_demo_corpus", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text() -> str:
    return load_corpus_text()


@pytest.fixture(scope="module")
def vocab(text: str) -> CharVocab:
    return CharVocab(text)


def _model(vocab_size: int, seed: int = 0) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(GPTConfig(vocab_size=vocab_size))


def test_generator_is_deterministic(gen: ModuleType, tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    gen.write_corpus(a, seed=7, size_bytes=20_000)
    gen.write_corpus(b, seed=7, size_bytes=20_000)
    assert a.read_bytes() == b.read_bytes()
    assert len(a.read_bytes()) >= 20_000
    gen.write_corpus(b, seed=8, size_bytes=20_000)
    assert a.read_bytes() != b.read_bytes()


def test_generator_main_cli(gen: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "c.txt"
    gen.main(["--out", str(out), "--seed", "3", "--size-bytes", "5000"])
    assert out.read_bytes() == gen.generate_corpus(3, 5000).encode("ascii")


def test_packaged_corpus_matches_fresh_generation(gen: ModuleType, text: str) -> None:
    assert text == gen.generate_corpus()
    assert len(text) >= gen.DEFAULT_SIZE_BYTES
    assert all(ch == "\n" or " " <= ch <= "~" for ch in text)


def test_vocab_round_trip(text: str, vocab: CharVocab) -> None:
    assert vocab.chars == sorted(set(text))
    assert len(vocab) == len(set(text))
    sample = text[:2000]
    ids = vocab.encode(sample)
    assert all(0 <= i < len(vocab) for i in ids)
    assert vocab.decode(ids) == sample
    assert CharVocab(text).encode(sample) == ids


@pytest.mark.parametrize(
    ("n", "block", "stride", "expected"),
    [
        (100, 10, None, 9),
        (101, 10, None, 10),
        (100, 10, 1, 90),
        (100, 10, 3, 30),
        (10, 10, None, 0),
    ],
)
def test_dataset_length(n: int, block: int, stride: int | None, expected: int) -> None:
    ds = CharDataset(torch.arange(n), block, stride)
    assert len(ds) == expected
    if expected:
        _, y = ds[len(ds) - 1]
        assert int(y[-1]) <= n - 1


def test_dataset_items_are_shifted_windows(text: str, vocab: CharVocab) -> None:
    data = encode_tensor(vocab, text)
    ds = CharDataset(data, block_size=64, stride=32)
    assert len(ds) == (data.numel() - 65) // 32 + 1
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == y.shape == (64,)
        assert torch.equal(x, data[i * 32 : i * 32 + 64])
        assert torch.equal(y, data[i * 32 + 1 : i * 32 + 65])
        assert torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_forward_shapes_and_loss(vocab: CharVocab) -> None:
    model = _model(len(vocab))
    idx = torch.randint(0, len(vocab), (3, 64))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 64, len(vocab))
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(len(vocab))) < 0.5
    logits, loss = model(idx[:, :10])
    assert logits.shape == (3, 10, len(vocab)) and loss is None
    with pytest.raises(ValueError):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_all_parameters_receive_gradients(vocab: CharVocab) -> None:
    model = _model(len(vocab))
    idx = torch.randint(0, len(vocab), (2, 16))
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_adamw_steps_reduce_loss(text: str, vocab: CharVocab) -> None:
    model = _model(len(vocab))
    ds = CharDataset(encode_tensor(vocab, text[:20_000]), block_size=64)
    x = torch.stack([ds[i][0] for i in range(8)])
    y = torch.stack([ds[i][1] for i in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_same_seed_gives_identical_parameters(vocab: CharVocab) -> None:
    a, b, c = _model(len(vocab), 5), _model(len(vocab), 5), _model(len(vocab), 6)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb)
    assert any(
        not torch.equal(pa, pc)
        for pa, pc in zip(a.state_dict().values(), c.state_dict().values(), strict=True)
    )


def test_dropout_depends_on_rng_state(vocab: CharVocab) -> None:
    model = _model(len(vocab))
    idx = torch.randint(0, len(vocab), (2, 64))
    model.train()
    state = torch.get_rng_state()
    first, _ = model(idx)
    second, _ = model(idx)
    assert not torch.equal(first, second)
    torch.set_rng_state(state)
    replay, _ = model(idx)
    assert torch.equal(first, replay)
    model.eval()
    e1, _ = model(idx)
    e2, _ = model(idx)
    assert torch.equal(e1, e2)
