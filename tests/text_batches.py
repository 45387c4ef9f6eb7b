"""Byte-level language-modelling batches of real English (Python's help topics, always installed)."""

import torch

_TEXT_BYTES = 120_000
_HELD_OUT = 100_000  # bytes before this train, bytes after it are held out


def _corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics)).encode("latin-1", "replace")[:_TEXT_BYTES]
    return torch.tensor(list(text), dtype=torch.long)


def text_batches(n: int, batch: int = 4, seq: int = 32, held_out: bool = False, seed: int = 0) -> list[dict]:
    """``n`` batches of ``batch`` random windows of ``seq`` bytes (token ids 0..255), labels = inputs."""
    data = _corpus()
    lo, hi = (_HELD_OUT, len(data) - seq) if held_out else (0, _HELD_OUT - seq)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(lo, hi, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq] for s in starts])
        out.append({"input_ids": ids, "labels": ids})
    return out
