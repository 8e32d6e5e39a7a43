"""Synthetic unpacked samples that follow the global-batch packing data contract and decode back.

Every real token encodes ``(sample id, offset)`` as ``(id + 1) * TOKEN_BASE + offset`` and its label
is ``token + 1``, so any packed, CP-split row can be traced to the exact samples and positions it
came from. Samples depend on (seed, step, DP rank) only, so CP and TP siblings see identical data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore_compat.contract import LENGTH_KEYS, TOKEN_KEYS
from mcore_compat.rules import alignment_multiple

__all__ = [
    "ITEM_LAYOUTS",
    "PAD_TOKEN_ID",
    "TOKEN_BASE",
    "Sample",
    "SampleSource",
    "SampleSpec",
    "alignment_multiple",
    "decode",
    "encode",
    "prepack",
]

TOKEN_BASE = 1_000_000
PAD_TOKEN_ID = 7
"""Distinctive pad id fed to the scheduler; it decodes to no sample (Megatron-Core writes 0 over padding)."""


def encode(sample_id: int, offset: int) -> int:
    """The token value of position ``offset`` of sample ``sample_id``."""
    return (sample_id + 1) * TOKEN_BASE + offset


def decode(token: int) -> tuple[int, int] | None:
    """``(sample id, offset)`` of a real token, or None for padding and anything not produced by :func:`encode`."""
    if token < TOKEN_BASE:
        return None
    return token // TOKEN_BASE - 1, token % TOKEN_BASE


@dataclass(frozen=True)
class Sample:
    """One unpacked sample: its global id, real length and padded length."""

    id: int
    length: int
    padded_length: int

    def token(self, offset: int) -> int:
        return encode(self.id, offset) if offset < self.length else PAD_TOKEN_ID

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The six contract keys: tokens, labels, loss_mask, position_ids, original_seq_len, padded_seq_len."""
        real = torch.arange(self.length, dtype=torch.int64) + encode(self.id, 0)
        pad = torch.full((self.padded_length - self.length,), PAD_TOKEN_ID, dtype=torch.int64)
        tokens = torch.cat((real, pad))
        loss_mask = torch.zeros(self.padded_length, dtype=torch.float32)
        loss_mask[: self.length] = 1.0
        return {
            "tokens": tokens,
            "labels": torch.where(loss_mask.bool(), tokens + 1, tokens),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(self.padded_length, dtype=torch.int64),
            "original_seq_len": torch.tensor([self.length], dtype=torch.int32),
            "padded_seq_len": torch.tensor([self.padded_length], dtype=torch.int32),
        }


ITEM_LAYOUTS: tuple[str, ...] = ("plain", "loose", "prepacked")
"""How a DP rank's items carry its samples, all within the data contract: ``plain`` as :meth:`Sample.as_dict`
builds them; ``loose`` as a default collate and a looser dataset would (``[1, L]`` fields, int64 ``[1, 1]``
lengths, extra keys); ``prepacked`` one pre-packed dict per pull (``cu_seqlens`` and ``cu_seqlens_padded``)."""


def _loose(sample: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {key: sample[key].unsqueeze(0) for key in TOKEN_KEYS}
    out.update({key: sample[key].to(torch.int64).reshape(1, 1) for key in LENGTH_KEYS})
    out["attention_mask"] = torch.ones(1, sample["tokens"].numel(), dtype=torch.bool)
    out["sample_index"] = 0
    return out


def prepack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Unpacked samples as one pre-packed sample (``cu_seqlens`` real, ``cu_seqlens_padded`` padded)."""
    out = {key: torch.cat([s[key] for s in samples]) for key in TOKEN_KEYS}
    for bounds, key in (("cu_seqlens", "original_seq_len"), ("cu_seqlens_padded", "padded_seq_len")):
        lengths = torch.cat([s[key] for s in samples])
        out[bounds] = torch.cat((torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)))
    return out


@dataclass(frozen=True)
class SampleSpec:
    """How one step's global batch is generated.

    ``num_microbatches`` items are pulled per DP rank, each a dict (``samples_per_next == 1``) or a
    list of dicts. Real lengths are drawn in ``[1, capacity]`` with a bias to short samples, and
    padded up to ``multiple``; ``capacity`` is the longest padded length the bins hold. DP rank ``r``
    gives its items in layout ``layouts[r % len(layouts)]`` (:data:`ITEM_LAYOUTS`).
    """

    seed: int
    dp: int
    num_microbatches: int
    samples_per_next: int
    multiple: int
    capacity: int
    long_fraction: float = 0.25
    layouts: tuple[str, ...] = ("plain",)

    def __post_init__(self) -> None:
        unknown = [layout for layout in self.layouts if layout not in ITEM_LAYOUTS]
        if not self.layouts or unknown:
            raise ValueError(f"layouts={self.layouts!r}: use one or more of {ITEM_LAYOUTS}")
        if self.capacity < self.multiple:
            raise ValueError(
                f"capacity={self.capacity} is below the alignment multiple {self.multiple}: raise "
                "max_seqlen_per_dp_cp_rank so one aligned sample fits a bin"
            )

    @property
    def samples_per_rank(self) -> int:
        return self.num_microbatches * self.samples_per_next

    def samples(self, step: int, dp_rank: int) -> list[Sample]:
        """The samples DP rank ``dp_rank`` feeds at ``step``, in pull order."""
        rng = random.Random(f"{self.seed}/{step}/{dp_rank}")
        longest = self.capacity - self.capacity % self.multiple
        short = max(1, min(longest, self.capacity // 4))
        first_id = (step * self.dp + dp_rank) * self.samples_per_rank
        out = []
        for index in range(self.samples_per_rank):
            length = rng.randint(1, longest if rng.random() < self.long_fraction else short)
            padded = -(-length // self.multiple) * self.multiple
            out.append(Sample(first_id + index, length, padded))
        return out

    def global_batch(self, step: int) -> list[Sample]:
        """Every sample of the step, across DP ranks."""
        return [s for dp_rank in range(self.dp) for s in self.samples(step, dp_rank)]

    def source(self, step: int, dp_rank: int) -> SampleSource:
        """A fresh iterator over this rank's items for ``step``."""
        layout = self.layouts[dp_rank % len(self.layouts)]
        return SampleSource(self.samples(step, dp_rank), self.samples_per_next, layout)


class SampleSource(Iterator[Any]):
    """Yields one item per ``next()`` in one of :data:`ITEM_LAYOUTS` and counts the pulls: a dict, a list of
    ``per_next`` dicts, or (``prepacked``) one dict holding ``per_next`` sequences."""

    def __init__(self, samples: list[Sample], per_next: int, layout: str = "plain") -> None:
        self._items = [samples[i : i + per_next] for i in range(0, len(samples), per_next)]
        self._per_next = per_next
        self._layout = layout
        self.pulls = 0

    def __next__(self) -> Any:
        if self.pulls >= len(self._items):
            raise StopIteration
        group = [s.as_dict() for s in self._items[self.pulls]]
        self.pulls += 1
        if self._layout == "prepacked":
            return prepack(group)
        if self._layout == "loose":
            group = [_loose(s) for s in group]
        return group[0] if self._per_next == 1 else group
