"""What each gloo rank runs in the bad-input suite (module-level, so spawn can pickle it).

One process group per layout plays every :class:`BadInput` in turn through the ``packing`` facade on
whichever backend the pin selects; each rank records what ``wrap`` (and, when it succeeded, the
fetches) raised, with the wall time, and the ranks meet at a barrier after every case so a rank left
inside a collective would show up as a timeout of the whole group.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import importlib
import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy
import torch
import torch.distributed as dist

from mcore_compat.adapters import select_adapter
from mcore_compat.capabilities import detect
from mcore_compat.errors import BadSampleError, PackingConfigError, PackingError
from mcore_compat.testing import Case, Layout, cpu_patches, model_config
from mcore_compat.testing.runner import mpu_pg_collection
from mcore_compat.testing.samples import prepack
from tests.observed_config import ObservedConfig


@dataclass(frozen=True)
class BadInput:
    """One defect: ``mutation`` of item ``index`` (every item when -1) on DP rank ``dp_rank`` (every DP rank when None).

    ``config`` overrides model-config fields on every rank (``drop`` removes them); ``num_microbatches``
    overrides it on the ranks ``dp_rank`` names; ``extra_fetch`` fetches once past the last microbatch.
    """

    name: str
    mutation: str | None = None
    dp_rank: int | None = 1
    index: int = 1
    config: tuple[tuple[str, Any], ...] = ()
    drop: tuple[str, ...] = ()
    num_microbatches: Any = None
    extra_fetch: bool = False
    cp_rank: int | None = None
    pp_rank: int | None = None
    """Only on this pipeline stage (-1: the last); every stage when None."""
    layouts: tuple[str, ...] = ()
    """Only these layouts (``str(Layout)``); all when empty."""
    rank_config: tuple[tuple[str, Any], ...] = ()
    """Model-config overrides on the ranks ``dp_rank`` names only (ranks that read different settings)."""
    dynamic_cp: bool = False
    """Run with ``default_dynamic_cp`` on dynamic-CP groups (the model support applied, as a trainer does)."""
    pg_drop: tuple[str, ...] = ()
    """Groups missing from the ``pg_collection`` that ``wrap`` gets on the ranks ``dp_rank`` names (``"*"``: None)."""
    fetch_from: str = "packed"
    """What the fetches get: the iterator ``wrap`` returned, the ``"raw"`` sample iterator, ``"none"``, a
    ``"list"`` (with VPP the list of every stage's iterators, else ``[iterator]``), or on TP rank 0 a ``"broken"``
    iterator whose ``next()`` raises."""
    fetch_config_none: bool = False
    """The fetches get None in place of the model config on the ranks ``dp_rank`` names (``wrap`` gets the config)."""
    elsewhere: str | None = None
    """A :func:`mutate` of every item ``mutation`` leaves alone, on every rank (e.g. all samples at capacity)."""
    config_as: str | None = None
    """What ``wrap`` gets in place of the model config on the ranks ``dp_rank`` names: ``"none"`` or ``"dict"``
    (its fields as a dict, as read from a YAML file)."""
    unreadable: str | None = None
    """A model-config field whose reading raises (as OmegaConf's ``MissingMandatoryValue``) on the ranks ``dp_rank``
    names."""
    rerun: bool = False
    """Run the step as Megatron-LM's ``train_step`` does when its rerun state machine reruns it in place: after every
    microbatch was fetched, the packed iterators are rewound and the step's microbatches fetched again (they must be
    the same)."""
    rewrap: bool = False
    """Wrap and fetch a first step on the same sample dict objects before the step under test (a dataset that hands
    out stored dicts again: an in-memory dataset, ``itertools.cycle``, a second epoch)."""
    unchecked: bool = False
    """Run the pin's own ``wrap`` and fetch through the adapter, without the facade's checks and agreement, on the
    good samples as every generation reads them (:func:`_reference_sources`): the microbatches good input must
    still give through the facade."""


def _per_token(sample: dict, fn: Callable[[torch.Tensor], torch.Tensor], keys: Sequence[str]) -> dict:
    return {k: (fn(v) if k in keys else v) for k, v in sample.items()}


def _lengths(sample: dict, original: Any = None, padded: Any = None) -> dict:
    out = dict(sample)
    if original is not None:
        out["original_seq_len"] = original
    if padded is not None:
        out["padded_seq_len"] = padded
    return out


def released(value: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """A copy of ``value`` whose storage holds only its first ``keep`` elements (0: freed, as FSDP-style memory reuse
    leaves a tensor); torch crashes the process reading most such tensors."""
    out = value.clone()
    out.untyped_storage().resize_(keep * out.itemsize)
    return out


def _padded_with(sample: dict, value: int) -> dict:
    """``sample`` with ``value`` in every padding slot of its tokens, labels and position ids (loss mask 0 there)."""
    padding = torch.arange(int(sample["padded_seq_len"])) >= int(sample["original_seq_len"])
    return {**sample, **{key: sample[key].masked_fill(padding, value) for key in ("tokens", "labels", "position_ids")}}


def _oversize(sample: dict, capacity: int) -> dict:
    long = dict(sample)
    for key in ("tokens", "labels", "position_ids"):
        long[key] = torch.arange(capacity, dtype=torch.int64)
    long["loss_mask"] = torch.ones(capacity)
    long["original_seq_len"] = long["padded_seq_len"] = torch.tensor([capacity], dtype=torch.int32)
    return long


def _collated_batches() -> Iterator[dict]:
    """Batches as a fixed-shape SFT collate makes them: ``[1, L]`` fields with ``cu_seqlens``, no padded bounds."""
    while True:
        yield {
            "tokens": torch.arange(8).reshape(1, 8),
            "labels": torch.arange(1, 9).reshape(1, 8),
            "loss_mask": torch.ones(1, 8),
            "position_ids": torch.arange(8).reshape(1, 8),
            "cu_seqlens": torch.tensor([0, 8], dtype=torch.int32),
            "max_seqlen": torch.tensor(8, dtype=torch.int32),
        }


def _without_tokens() -> Iterator[dict]:
    """Microbatches with the metadata every fetch reads but no ``tokens`` (which a first stage's fetch reads)."""
    while True:
        yield {
            "labels": torch.arange(1, 9),
            "loss_mask": torch.ones(8),
            "position_ids": torch.arange(8),
            "cu_seqlens": torch.tensor([0, 8], dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor([0, 8], dtype=torch.int32),
            "max_seqlen": torch.tensor(8, dtype=torch.int32),
        }


FETCH_SOURCES: dict[str, Callable[[], Iterator[Any]]] = {
    "collated": _collated_batches,
    "without_tokens": _without_tokens,
    "spent": lambda: iter(()),
    "strings": lambda: itertools.repeat("not a microbatch"),
}
"""What a fetch gets on TP rank 0 instead of the step's packed iterator (a ``BadInput.fetch_from``)."""


def _left_padded(sample: dict, align: int) -> dict:
    """A sample padded on the left: one pad slot first, then its real tokens (and their loss), to an aligned length."""
    padded = max(2, align)
    out = dict(sample)
    out["tokens"] = torch.cat((torch.zeros(1, dtype=torch.int64), torch.arange(1, padded, dtype=torch.int64)))
    out["labels"] = out["tokens"] + 1
    out["loss_mask"] = torch.cat((torch.zeros(1), torch.ones(padded - 1)))
    out["position_ids"] = torch.arange(padded, dtype=torch.int64)
    out["original_seq_len"] = torch.tensor([padded - 1], dtype=torch.int32)
    out["padded_seq_len"] = torch.tensor([padded], dtype=torch.int32)
    return out


def _prepacked_decreasing(sample: dict) -> dict:
    out = {k: v for k, v in sample.items() if not k.endswith("seq_len")}
    n = int(sample["padded_seq_len"])
    out["cu_seqlens"] = torch.tensor([0, n, n - 1 if n > 1 else 0, n], dtype=torch.int32)
    return out


class _LazyList(list):
    """A lazily loaded list of samples whose loading fails when it is iterated (a shard that cannot be read)."""

    def __iter__(self) -> Any:
        raise OSError("shard file missing")


class _UndecodableSample(dict):
    """A lazily decoded sample whose decoding fails when a field is read (``get``, as the checks read it)."""

    def get(self, key: Any, default: Any = None) -> Any:
        raise RuntimeError(f"cannot decode {key!r}")


_COUNTING = torch.arange(1 << 16, dtype=torch.int64)
"""One counting tensor that every ``shared_positions`` sample's ``position_ids`` is a view of (a dataset's cache)."""


def _shared_buffer(sample: dict) -> dict:
    """``tokens`` and ``labels`` as two views of one buffer (the same values)."""
    n = sample["tokens"].numel()
    buffer = torch.cat((sample["tokens"], sample["labels"]))
    return {**sample, "tokens": buffer[:n], "labels": buffer[n:]}


_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_LENGTH_KEYS = ("original_seq_len", "padded_seq_len")
_ANY_DTYPE = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)


class _Subclass(torch.Tensor):
    """A tensor subclass a dataset might hand out."""


def _random_field_defect(rng: random.Random, s: dict, capacity: int, align: int) -> dict:
    """One random change of one field of an unpacked sample (most are defects, some are harmless)."""
    s, n = dict(s), int(s["padded_seq_len"])
    key, length = rng.choice(_TOKEN_KEYS), rng.choice(_LENGTH_KEYS)
    value, kind = s[key], rng.randrange(9)
    if kind == 0:
        s[key] = value.to(rng.choice(_ANY_DTYPE))
    elif kind == 1:
        size = rng.choice([0, 1, n - 1, n + 1, n + align, 2 * n])
        s[key] = torch.cat([value, value])[:size]
    elif kind == 2:
        s[key] = rng.choice(
            [value.reshape(1, -1), value.reshape(-1, 1), value.repeat_interleave(2)[::2], value[:1].expand(n)]
        )
    elif kind == 3:
        size = rng.choice([-1, 0, 1, n - 1, n + 1, capacity, capacity + align, 2**31 - 1, 2**40])
        s[length] = torch.tensor([size], dtype=rng.choice([torch.int32, torch.int64]) if abs(size) < 2**31 else None)
    elif kind == 4:
        s[length] = s[length].to(rng.choice(_ANY_DTYPE))
    elif kind == 5:
        v = s[length]
        s[length] = rng.choice([v.reshape(()), v.reshape(1, 1), v[:0], int(v), float(v), v.numpy(), v.tolist()])
    elif kind == 6:
        choice = rng.randrange(4)
        if choice == 0:
            del s[rng.choice((key, length))]
        elif choice == 1:
            s["cu_seqlens_padded"] = torch.tensor([0, n], dtype=torch.int32)
        elif choice == 2:
            s["note"] = object()
        else:
            s[1] = torch.zeros(1)
    elif kind == 7:
        changed = value.clone()
        where = rng.randrange(max(changed.numel(), 1))
        if changed.numel():
            changed[where] = rng.choice([-1, 0, 2, 10**6]) if key != "loss_mask" else rng.choice([-1.0, 2.0, 0.5])
        s[key] = changed
    else:
        s[key] = rng.choice([value.as_subclass(_Subclass), value.to("meta"), released(value, value.numel() // 2)])
    return s


def random_defect(seed: int, item: Any, capacity: int, align: int) -> Any:
    """One or two random field changes (:func:`_random_field_defect`) of the sample, the same for a seed on every
    rank: a family of inputs no case of the table spells out, to which every rank must answer alike."""
    rng = random.Random(seed)
    for _ in range(rng.choice((1, 1, 2))):
        if not isinstance(item, dict) or "padded_seq_len" not in item:
            break
        try:
            item = _random_field_defect(rng, item, capacity, align)
        except (TypeError, ValueError, RuntimeError):  # a change torch refuses (e.g. int() of an empty length)
            break
    return item


_SETTING_VALUES: dict[str, tuple[Any, ...]] = {
    "sequence_packing_scheduler": (
        "dp_balanced",
        "default_dynamic_cp",
        "balanced",
        "DP_BALANCED",
        "dp_balanced ",
        None,
        3,
    ),
    "max_seqlen_per_dp_cp_rank": (32, 64, 16, 0, -32, 32.0, None, "32", True, numpy.int64(32), torch.tensor(32), 2**40),
    "dynamic_context_parallel": (True, False, None, 1, 0, "yes", "False", numpy.bool_(True)),
    "min_dynamic_context_parallel_size": (1, 2, 3, 4, 0, -1, 2.0, None, "2", 8, numpy.int64(2)),
    "thd_max_packed_sequences": (None, 1, 2, 8, 0, -1, 2.5, "8", True, numpy.int64(8)),
    "pad_packed_seq_alignment": (None, 1, 8, 16, 0, -8, 8.0, "8", True, 3, 64),
    "thd_tail_padding_policy": (None, "append_dummy_seq", "extend_last", "extend", 1),
    "cp_partition_mode": ("zigzag", "contiguous", "ZIGZAG", None, 1),
    "virtual_pipeline_model_parallel_size": (None, 1, 2, 0, 1.0),
    "microbatch_group_size_per_vp_stage": (None, 1, 2, 4, 3, 0, -1),
    "sequence_parallel": (True, False, "False", 1),
    "cuda_graph_impl": ("none", "local", "full_iteration", None),
}
"""Values, good and bad, of the settings a packing step reads."""
_MICROBATCH_COUNTS = (4, 3, 0, -1, 4.0, numpy.int64(4), True, None, "4", torch.tensor(4), 8, 1)


def random_settings(seed: int) -> BadInput:
    """One to three settings from :data:`_SETTING_VALUES` (and sometimes ``num_microbatches``), on every rank or on
    DP rank 1 only, with static or dynamic CP: the same case for a seed on every rank."""
    rng = random.Random(seed)
    chosen = rng.sample(sorted(_SETTING_VALUES), rng.choice((1, 1, 2, 3)))
    values = tuple((name, rng.choice(_SETTING_VALUES[name])) for name in chosen)
    count = rng.choice(_MICROBATCH_COUNTS) if rng.random() < 0.2 else None
    dynamic_cp, one_rank = rng.random() < 0.3, rng.random() < 0.4
    name = f"random settings {seed}"
    if one_rank:
        return BadInput(name, rank_config=values, dp_rank=1, num_microbatches=count, dynamic_cp=dynamic_cp)
    return BadInput(name, config=values, dp_rank=rng.choice((None, 1)), num_microbatches=count, dynamic_cp=dynamic_cp)


def mutate(name: str, item: Any, capacity: int, align: int) -> Any:
    """The item with defect ``name`` (one unpacked sample dict); ``random:<seed>``: :func:`random_defect`."""
    if name.startswith("random:"):
        return random_defect(int(name.removeprefix("random:")), item, capacity, align)
    if name.startswith("pad_ids:"):
        return _padded_with(item, int(name.removeprefix("pad_ids:")))
    s = item
    n = int(s["padded_seq_len"]) if isinstance(s, dict) and "padded_seq_len" in s else 0
    table: dict[str, Callable[[], Any]] = {
        "drop_labels": lambda: {k: v for k, v in s.items() if k != "labels"},
        "drop_lengths": lambda: {k: v for k, v in s.items() if not k.endswith("seq_len")},
        "short_labels": lambda: {**s, "labels": s["labels"][:-1]},
        "lying_padded": lambda: _lengths(s, padded=torch.tensor([n + align], dtype=torch.int32)),
        "negative_original": lambda: _lengths(s, original=torch.tensor([-3], dtype=torch.int32)),
        "negative_padded": lambda: _lengths(s, padded=torch.tensor([-4], dtype=torch.int32)),
        "original_above_padded": lambda: _lengths(s, original=torch.tensor([n + 1], dtype=torch.int32)),
        "original_zero": lambda: _lengths(s, original=torch.tensor([0], dtype=torch.int32)),
        "nan_length": lambda: _lengths(s, padded=torch.tensor([float("nan")])),
        "float_length": lambda: _lengths(s, padded=torch.tensor([float(n)])),
        "float_original": lambda: _lengths(s, original=torch.tensor([n - 0.5])),
        "python_int_length": lambda: _lengths(s, padded=n),
        "scalar_length": lambda: _lengths(s, padded=torch.tensor(n, dtype=torch.int32)),
        "two_lengths": lambda: _lengths(s, padded=torch.tensor([n, n], dtype=torch.int32)),
        "bool_length": lambda: _lengths(s, padded=torch.tensor([True])),
        "string": lambda: "not a sample",
        "none_item": lambda: None,
        "empty_list": lambda: [],
        "list_with_string": lambda: [s, "x"],
        "tokens_int32": lambda: _per_token(s, lambda v: v.int(), ("tokens",)),
        "loss_mask_bool": lambda: _per_token(s, lambda v: v.bool(), ("loss_mask",)),
        "tokens_list": lambda: {**s, "tokens": s["tokens"].tolist()},
        "tokens_2d": lambda: {**s, "tokens": s["tokens"].reshape(-1, 1).expand(-1, 2).contiguous()},
        "tokens_meta": lambda: _per_token(s, lambda v: v.to("meta"), ("tokens",)),
        "loss_mask_sparse": lambda: _per_token(s, lambda v: v.to_sparse(), ("loss_mask",)),
        "undecodable": lambda: _UndecodableSample(s),
        "other_tokens": lambda: {**s, "tokens": s["tokens"] ^ 1},
        "one_token_unmasked": lambda: {**s, "loss_mask": torch.cat((1 - s["loss_mask"][:1], s["loss_mask"][1:]))},
        "zero_positions": lambda: {**s, "position_ids": torch.zeros_like(s["position_ids"])},
        "shifted_positions": lambda: {**s, "position_ids": s["position_ids"] + 1},
        "left_padded": lambda: _left_padded(s, align),
        "both_forms": lambda: {**s, "cu_seqlens": torch.tensor([0, n], dtype=torch.int32)},
        "cu_decreasing": lambda: _prepacked_decreasing(s),
        "prepacked": lambda: prepack([s]),
        "oversize": lambda: _oversize(s, capacity + align),
        "at_capacity": lambda: _oversize(s, capacity),
        "shortest": lambda: _oversize(s, align),
        "odd_length": lambda: _oversize(s, 3),
        "two_at_capacity": lambda: [_oversize(s, capacity), _oversize(s, capacity)],
        "no_original": lambda: {k: v for k, v in s.items() if k != "original_seq_len"},
        "misaligned": lambda: _oversize(s, capacity - 1),
        "loss_mask_requires_grad": lambda: _per_token(s, lambda v: v.clone().requires_grad_(), ("loss_mask",)),
        "strided_tokens": lambda: _per_token(s, lambda v: v.repeat_interleave(2)[::2], ("tokens", "labels")),
        "position_ids_int32": lambda: _per_token(s, lambda v: v.int(), ("position_ids",)),
        "loss_mask_float16": lambda: _per_token(s, lambda v: v.half(), ("loss_mask",)),
        "tuple_item": lambda: (s,),
        "user_dict": lambda: collections.UserDict(s),
        "lengths_2d": lambda: {**s, "padded_seq_len": s["padded_seq_len"].reshape(1, 1)},
        "lengths_int64": lambda: {**s, "padded_seq_len": s["padded_seq_len"].long()},
        "unsqueezed": lambda: {
            k: v.unsqueeze(0) if k not in ("padded_seq_len", "original_seq_len") else v for k, v in s.items()
        },
        "all_real": lambda: _lengths(s, original=s["padded_seq_len"].clone()),
        "prepacked_whole32": lambda: {
            **{k: v for k, v in s.items() if not k.endswith("seq_len")},
            "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
        },
        "prepacked_whole64": lambda: {
            **{k: v for k, v in s.items() if not k.endswith("seq_len")},
            "cu_seqlens": torch.tensor([0, n], dtype=torch.int64),
        },
        "extra_tensor_key": lambda: {**s, "attention_mask": torch.ones(n, dtype=torch.bool)},
        "extra_scalar_key": lambda: {**s, "sample_id": 7},
        "extra_string_key": lambda: {**s, "source": "wiki"},
        "uint32_padded": lambda: _lengths(s, padded=torch.tensor([n], dtype=torch.uint32)),
        "uint16_original": lambda: _lengths(s, original=s["original_seq_len"].to(torch.uint16)),
        "int8_lengths": lambda: _lengths(s, s["original_seq_len"].to(torch.int8), s["padded_seq_len"].to(torch.int8)),
        "uint64_cu_seqlens": lambda: {**(p := prepack([s])), "cu_seqlens": p["cu_seqlens"].to(torch.uint64)},
        "huge_padded": lambda: _lengths(s, padded=torch.tensor([1 << 40], dtype=torch.int64)),
        "numpy_tokens": lambda: {**s, "tokens": s["tokens"].numpy()},
        "shared_positions": lambda: {**s, "position_ids": _COUNTING[:n]},
        "shared_buffer": lambda: _shared_buffer(s),
        "empty_prepacked": lambda: {
            **{k: v[:0] for k, v in s.items() if not k.endswith("seq_len")},
            "cu_seqlens": torch.tensor([0, 0], dtype=torch.int32),
        },
        "uint64_padded_max": lambda: _lengths(s, padded=torch.tensor([-1]).to(torch.uint64)),
        "uint64_original_2_63": lambda: _lengths(s, original=torch.tensor([1 << 63], dtype=torch.uint64)),
        "quantized_padded": lambda: _lengths(
            s, padded=torch.quantize_per_tensor(torch.tensor([float(n)]), 1.0, 0, torch.qint32)
        ),
        "lazy_list": lambda: _LazyList([s]),
        "masked_loss_mask": lambda: {
            **s,
            "loss_mask": torch.masked.masked_tensor(s["loss_mask"], torch.ones(n, dtype=torch.bool)),
        },
        "subclass_labels": lambda: {**s, "labels": s["labels"].as_subclass(_Subclass)},
        "negative_token": lambda: {**s, "tokens": torch.cat((s["tokens"][:1] * 0 - 1, s["tokens"][1:]))},
        "ignore_label_trained": lambda: {
            **s,
            "labels": torch.cat((s["labels"][:1] * 0 - 100, s["labels"][1:])),
            "loss_mask": torch.cat((s["loss_mask"][:1] * 0 + 1, s["loss_mask"][1:])),
        },
        "ignore_label_untrained": lambda: {
            **s,
            "labels": torch.where(s["loss_mask"] == 0, -100, s["labels"]).index_fill(0, torch.tensor([0]), -100),
            "loss_mask": s["loss_mask"].index_fill(0, torch.tensor([0]), 0.0),
        },
        "padded_meta": lambda: _lengths(s, padded=s["padded_seq_len"].to("meta")),
        "tokens_freed": lambda: _per_token(s, released, ("tokens",)),
        "loss_mask_shrunk": lambda: _per_token(s, lambda v: released(v, v.numel() // 2), ("loss_mask",)),
        "padded_freed": lambda: _lengths(s, padded=released(s["padded_seq_len"])),
        "original_meta": lambda: _lengths(s, original=s["original_seq_len"].to("meta")),
        "empty_prepacked_padded": lambda: {
            **{k: v[:0] for k, v in s.items() if not k.endswith("seq_len")},
            "cu_seqlens": torch.tensor([0, 0], dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor([0, 0], dtype=torch.int32),
        },
    }
    return table[name]()


class _Mutated(Iterator[Any]):
    def __init__(
        self, source: Iterator[Any], index: int, fn: Callable[[Any], Any], rest: Callable[[Any], Any] | None = None
    ) -> None:
        self._source, self._index, self._fn, self._rest, self._pulled = source, index, fn, rest, 0

    def __next__(self) -> Any:
        item = next(self._source)
        self._pulled += 1
        if self._index in (-1, self._pulled - 1):
            return self._fn(item)
        return item if self._rest is None else self._rest(item)


class _Raising(Iterator[Any]):
    def __init__(self, source: Iterator[Any], index: int, error: BaseException | None = None) -> None:
        self._source, self._index, self._pulled = source, index, 0
        self._error = KeyError("dataset bug") if error is None else error

    def __next__(self) -> Any:
        if self._pulled == self._index:
            raise self._error
        self._pulled += 1
        return next(self._source)


ITERATOR_MUTATIONS = ("exhausted", "raising", "cancelled", "none_iterator", "list", "aliased", "duplicated")
"""Mutations of the data iterator itself; every other one is a :func:`mutate` of one item."""
STAGE_MUTATIONS = ("stages_short", "stages_not_a_list", "stages_none", "stages_first_only", "stages_last_only")
"""Mutations of the list of per-virtual-stage iterators (with VPP): one entry short, one iterator in place of the
list, None in every entry, an iterator in the first (or last) entry only."""


def _hit(bad: BadInput, pg: Any) -> bool:
    """Whether the case's defect is on this rank."""
    stage = None if bad.pp_rank is None else bad.pp_rank % pg.pp.size()
    return (
        (bad.dp_rank is None or bad.dp_rank == pg.dp.rank())
        and (bad.cp_rank is None or bad.cp_rank == pg.cp.rank())
        and (stage is None or stage == pg.pp.rank())
    )


def _stage_sources(case: Case, bad: BadInput, pg: Any, virtual: int | None) -> Any:
    """What this rank passes to ``wrap``: with ``virtual`` stages, one iterator per stage on TP rank 0 (each
    over this DP rank's samples, as a trainer builds one per model chunk) and None per stage elsewhere."""
    if bad.unchecked:
        return _reference_sources(case, pg, virtual)
    if virtual is None:
        return _source(case, bad, pg)
    if pg.tp.rank() != 0:
        return [None] * virtual
    if bad.mutation not in STAGE_MUTATIONS or not _hit(bad, pg):
        return [_source(case, bad, pg) for _ in range(virtual)]
    clean = BadInput(bad.name)
    if bad.mutation == "stages_not_a_list":
        return _source(case, clean, pg)
    if bad.mutation == "stages_none":
        return [None] * virtual
    if bad.mutation in ("stages_first_only", "stages_last_only"):
        only = 0 if bad.mutation == "stages_first_only" else virtual - 1
        return [_source(case, clean, pg) if v == only else None for v in range(virtual)]
    return [_source(case, clean, pg) for _ in range(virtual - 1)]


def _reference_sources(case: Case, pg: Any, virtual: int | None) -> Any:
    """The samples as every native generation's own ``wrap`` reads them: pre-packed, with VPP only in the entry
    each pipeline edge loads (``[0]`` on the first stage, ``[-1]`` on the last)."""
    source = _source(case, BadInput("reference", dp_rank=None), pg)
    if source is not None:
        source = (prepack([item]) for item in source)
    if virtual is None:
        return source
    first, last = pg.pp.rank() == 0, pg.pp.rank() == pg.pp.size() - 1
    return [source if (first and v == 0) or (last and v == virtual - 1) else None for v in range(virtual)]


def _source(case: Case, bad: BadInput, pg: Any) -> Iterator[Any] | None:
    if pg.tp.rank() != 0:
        return None
    source = case.sample_spec.source(0, pg.dp.rank())
    hit = _hit(bad, pg)
    capacity = case.max_seqlen_per_dp_cp_rank * case.layout.cp
    align = case.sample_spec.multiple
    rest = None if bad.elsewhere is None else functools.partial(mutate, bad.elsewhere, capacity=capacity, align=align)
    if not hit or bad.mutation is None:
        return source if rest is None else _Mutated(source, -2, lambda item: item, rest)
    if bad.mutation == "exhausted":
        return iter([next(source) for _ in range(bad.index)])
    if bad.mutation == "raising":
        return _Raising(source, bad.index)
    if bad.mutation == "cancelled":  # a BaseException, as an async prefetcher's CancelledError is
        return _Raising(source, bad.index, asyncio.CancelledError())
    if bad.mutation == "none_iterator":
        return None
    if bad.mutation == "list":
        return [next(source) for _ in range(case.num_microbatches)]  # type: ignore[return-value]
    if bad.mutation in ("aliased", "duplicated"):
        items = [next(source) for _ in range(case.num_microbatches)]
        previous = items[bad.index - 1]
        items[bad.index] = previous if bad.mutation == "aliased" else {k: v.clone() for k, v in previous.items()}
        return iter(items)
    return _Mutated(source, bad.index, lambda item: mutate(bad.mutation, item, capacity, align), rest)  # type: ignore[arg-type]


@dataclass
class Outcome:
    """What one rank saw for one case."""

    name: str
    rank: int
    kind: str
    message: str
    bad_sample_error: bool = False
    config_error: bool = False
    packing_error: bool = False
    seconds: float = 0.0
    microbatches: int = 0
    fetch: tuple[str, str] = ("skipped", "")
    stage_fetches: list[tuple[str, str]] = field(default_factory=list)
    """With ``extra_fetch``: what the fetch past the last microbatch raised on each virtual stage (``fetch``: the
    first)."""
    fetched: list[list[list[float]]] = field(default_factory=list)
    """Per fetched microbatch, :func:`_microbatch_record`."""
    config_reads: list[str] = field(default_factory=list)
    """The model-config fields read on this rank in the case's wrap and fetches."""


def _config(case: Case, bad: BadInput, dp_rank: int) -> ObservedConfig:
    config = model_config(case)
    for key, value in bad.config:
        setattr(config, key, value)
    named = bad.dp_rank is None or bad.dp_rank == dp_rank
    if named:
        for key, value in bad.rank_config:
            setattr(config, key, value)
    for key in bad.drop:
        delattr(config, key)
    return ObservedConfig(vars(config), bad.unreadable if named else None)


def _wrap_pg(bad: BadInput, pg: Any) -> Any:
    """The collection ``wrap`` gets: ``pg``, or on the ranks the case names a copy without ``bad.pg_drop``."""
    if not bad.pg_drop or not (bad.dp_rank is None or bad.dp_rank == pg.dp.rank()):
        return pg
    if "*" in bad.pg_drop:
        return None
    return SimpleNamespace(
        **{name: getattr(pg, name) for name in ("tp", "pp", "cp", "dp", "dp_cp") if name not in bad.pg_drop}
    )


def _microbatch_record(batch: Any) -> list[list[float]]:
    """A fetched microbatch as lists: tokens, labels, loss mask, positions and the sequence boundaries (empty where
    the stage gets None)."""
    fields = [batch[i] for i in (0, 1, 2, 4)]
    params = batch[5]
    bounds = [getattr(params, name, None) for name in ("cu_seqlens_q", "cu_seqlens_q_padded")]
    return [t.reshape(-1).tolist() if isinstance(t, torch.Tensor) else [] for t in (*fields, *bounds)]


def _streams(packed: Any, virtual: int | None) -> list[tuple[Any, int | None]]:
    """What each fetch of a microbatch gets, with its ``vp_stage``: with VPP each virtual stage's entry of ``packed``
    (a list as ``wrap`` returns it; anything else as given to every stage), else ``packed`` itself."""
    if virtual is None:
        return [(packed, None)]
    return [(packed[v] if isinstance(packed, list) else packed, v) for v in range(virtual)]


def _fetch_all(fetch: Callable[..., Any], packed: Any, count: int, config: Any, pg: Any, virtual: int | None) -> list:
    """Every microbatch of the step, microbatch by microbatch, each virtual stage's in turn (so a stage whose fetch
    edits a microbatch shared with a later stage is seen)."""
    return [
        _microbatch_record(fetch(stream, config, pg_collection=pg, vp_stage=v))
        for _ in range(count)
        for stream, v in _streams(packed, virtual)
    ]


@contextlib.contextmanager
def _rerun_machine(on: bool) -> Iterator[Any]:
    """Megatron-Core's rerun state machine validating results (its data iterators keep the step's microbatches), in
    its state before a step; restored after. None where ``on`` is false."""
    if not on:
        yield None
        return
    rerun = importlib.import_module("megatron.core.rerun_state_machine")
    machine = rerun.get_rerun_state_machine()
    mode, state = machine.mode, machine.state
    machine.mode = rerun.RerunMode.VALIDATE_RESULTS
    try:
        yield machine
    finally:
        machine.mode, machine.state = mode, state


def _replay(items: list[Any] | None) -> Iterator[Any] | None:
    return None if items is None else iter(items)


def _run(bad: BadInput, case: Case, pg: Any, rank: int, virtual: int | None = None) -> Outcome:
    import packing

    config = _config(case, bad, pg.dp.rank())
    if virtual is not None:
        config.virtual_pipeline_model_parallel_size = virtual
        config.microbatch_group_size_per_vp_stage = pg.pp.size()
    num_microbatches = case.num_microbatches
    if bad.num_microbatches is not None and (bad.dp_rank is None or bad.dp_rank == pg.dp.rank()):
        num_microbatches = bad.num_microbatches
    source = _stage_sources(case, bad, pg, virtual)
    wrap_pg = _wrap_pg(bad, pg)
    wrap_config: Any = config
    if bad.config_as is not None and (bad.dp_rank is None or bad.dp_rank == pg.dp.rank()):
        wrap_config = None if bad.config_as == "none" else config.fields()
    wrap, fetch = packing.wrap_data_iterator_for_global_batch_packing, packing.get_batch_for_global_batch_packing
    if bad.unchecked:  # an adapter of its own: it never wraps, so no count of fetches from another case applies
        own = select_adapter(detect())
        wrap, fetch = own.scheduler_api()[0], own.get_batch
    start = time.perf_counter()
    outcome = Outcome(bad.name, rank, "ok", "")
    try:
        if bad.rewrap:  # a first step on the same sample dicts, fetched whole, then the step under test
            items = None if source is None else list(source)
            packed, count, _, _ = wrap(_replay(items), wrap_config, num_microbatches, pg_collection=wrap_pg)
            _fetch_all(fetch, packed, int(count), config, pg, virtual)
            source = _replay(items)
        packed, count, _, _ = wrap(source, wrap_config, num_microbatches, pg_collection=wrap_pg)
        outcome.microbatches = count = int(count)
        if bad.fetch_from == "list":  # every fetch gets a list: all stages' iterators (VPP) or [the iterator]
            packed = [packed] * virtual if virtual is not None else [packed]
        elif bad.fetch_from == "broken":  # on TP rank 0 an iterator whose next() raises (its DataLoader died)
            packed = _Raising(iter(()), 0, RuntimeError("DataLoader worker exited")) if pg.tp.rank() == 0 else None
        elif bad.fetch_from in FETCH_SOURCES:  # on TP rank 0 an iterator that is not this step's packed one
            packed = FETCH_SOURCES[bad.fetch_from]() if pg.tp.rank() == 0 else None
        elif bad.fetch_from != "packed":
            packed = source if bad.fetch_from == "raw" else None
        fetch_config = None if bad.fetch_config_none and bad.dp_rank in (None, pg.dp.rank()) else config
        with _rerun_machine(bad.rerun) as machine:
            outcome.fetched = _fetch_all(fetch, packed, count, fetch_config, pg, virtual)
            if machine is not None:
                machine.state = type(machine.state)["RERUNNING_IN_PLACE"]
                for stream, _ in _streams(packed, virtual):
                    if stream is not None:
                        stream.rewind()
                if _fetch_all(fetch, packed, count, fetch_config, pg, virtual) != outcome.fetched:
                    raise AssertionError("the rerun fetched other microbatches than the first run")
    except BaseException as exc:  # noqa: BLE001 - the test compares what every rank raised
        outcome.kind, outcome.message = type(exc).__name__, str(exc)
        outcome.bad_sample_error = isinstance(exc, BadSampleError)
        outcome.config_error = isinstance(exc, PackingConfigError)
        outcome.packing_error = isinstance(exc, PackingError)
    outcome.seconds = time.perf_counter() - start
    if outcome.kind == "ok" and bad.extra_fetch:
        for stream, v in _streams(packed, virtual):
            try:
                fetch(stream, config, pg_collection=pg, vp_stage=v)
                outcome.stage_fetches.append(("ok", ""))
            except BaseException as exc:  # noqa: BLE001
                outcome.stage_fetches.append((type(exc).__name__, str(exc)))
        outcome.fetch = outcome.stage_fetches[0]
    outcome.config_reads = sorted(config._reads)
    return outcome


def bad_inputs_on_rank(
    rank: int,
    world_size: int,
    layout: Layout,
    cases: Sequence[BadInput],
    base: dict[str, Any],
    pipeline: int = 1,
    virtual: int | None = None,
) -> dict[str, Any]:
    """Every case on this rank for one layout, in one process group; also reports the backend.

    ``pipeline`` pipeline stages of ``layout`` each (``world_size`` = ``pipeline`` x the layout's size), each with
    ``virtual`` interleaved virtual stages (None: no VPP): a list of iterators per rank, fetched stage by stage.
    """
    import packing
    from mcore_compat import adapter

    outcomes = []
    runs = (
        (Case(layout, steps=1, **base), [bad for bad in cases if not bad.dynamic_cp]),
        (Case(layout, "default_dynamic_cp", dynamic_cp=True, steps=1, **base), [b for b in cases if b.dynamic_cp]),
    )
    with cpu_patches(context_parallel=layout.cp > 1, dynamic_cp=True):
        state = importlib.import_module("megatron.core.parallel_state")
        for case, group in runs:
            if not group:
                continue
            keywords: dict[str, Any] = {}
            if case.dynamic_cp:
                packing.enable_dynamic_cp_model_support()
                refusal = packing.probe_global_batch_packing_support("default_dynamic_cp", dynamic_cp=True)
                if refusal is not None:  # this pin cannot run dynamic CP at all: nothing to feed bad input to
                    outcomes += [Outcome(bad.name, rank, "skipped", refusal) for bad in group]
                    continue
                keywords = packing.dynamic_cp_initialize_keywords(1)
            state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=pipeline,
                context_parallel_size=layout.cp,
                **keywords,
            )
            try:
                pg = mpu_pg_collection()
                for bad in group:
                    if bad.layouts and str(layout) not in bad.layouts:
                        continue
                    outcomes.append(_run(bad, case, pg, rank, virtual))
                    dist.barrier()
            finally:
                state.destroy_model_parallel()
    return {
        "backend": adapter().backend,
        "generation": adapter().capabilities.generation,
        "replays_unedited": _replays_unedited(),
        "outcomes": outcomes,
    }


def _replays_unedited() -> bool:
    """Whether the pin's ``RerunDataIterator`` replays a microbatch as it was yielded, after the consumer edited the
    dict (dev keeps a shallow copy since late 2026; older commits keep the dict itself, which Megatron-Core's fetch
    edits, so a rerun in place fails in their own fetch at TP 1)."""
    rerun = importlib.import_module("megatron.core.rerun_state_machine")
    with _rerun_machine(True):
        iterator = rerun.RerunDataIterator(iter([{"tokens": 1}]))
        next(iterator)["tokens"] = 2
        iterator.rewind()
        return next(iterator)["tokens"] == 1
