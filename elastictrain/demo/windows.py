"""How the demo cuts its packaged corpus into training windows, without torch: the
demo's runner checks a resume against the dataset's length before any process of the
job has imported torch (seconds that a user waits for at every start)."""

from __future__ import annotations

from importlib.resources import files

# The context length of the demo's model (demo/model.py's GPTConfig.block_size).
BLOCK_SIZE = 64


def load_corpus_text() -> str:
    """Return the text of the packaged ``data/corpus.txt``."""
    return (files("elastictrain.demo") / "data" / "corpus.txt").read_text(encoding="ascii")


def window_count(tokens: int, block_size: int, stride: int | None = None) -> int:
    """Windows of ``block_size`` inputs (plus the shifted target: one token more) that
    start every ``stride`` tokens (``block_size`` by default) in ``tokens`` tokens."""
    step = block_size if stride is None else stride
    usable = tokens - block_size - 1
    return 0 if usable < 0 else usable // step + 1


def corpus_windows(block_size: int = BLOCK_SIZE) -> int:
    """Windows in the packaged corpus (one character is one token)."""
    return window_count(len(load_corpus_text()), block_size)
