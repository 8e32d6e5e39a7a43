"""The data contract of global-batch packing, written once for every pin and backend.

A trainer hands the facade, per step and per data-loading rank, ``num_microbatches`` items; each
item is one sample dict or a list of them. A sample comes in one of two forms:

- **unpacked**: one sequence. ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``[L]``, or
  ``[1, L]`` from a default collate), ``padded_seq_len`` (``L``) and optionally ``original_seq_len``
  (the real length, default ``L``), each length an integer tensor of one element (``[1]``).
- **pre-packed** (Megatron-LM ``SFTDataset`` style): the same per-token fields holding several
  sequences back to back, and ``cu_seqlens`` (int, ``[n + 1]``) marking them. With
  ``cu_seqlens_padded`` too, ``cu_seqlens_padded`` marks the sequences in the buffer and
  ``cu_seqlens`` counts their real tokens (Megatron-Core's THD convention); without it each
  sequence is all real. Zero-length sequences (``SFTDataset`` pads ``cu_seqlens`` with them) are skipped, but a
  sample needs at least one sequence.

Every sequence: at least one real token, ``original <= padded``, ``padded`` a multiple of
:func:`mcore_compat.rules.alignment_multiple` and at most the bin capacity, ``position_ids`` ``0 .. original - 1`` over
its real tokens. Token ids are ``>= 0`` on every real slot and labels ``>= 0`` wherever ``loss_mask`` is not 0 (an
ignore index such as -100 only where it is 0). Padding slots may hold any id and position: every path writes 0 over
them before the model reads them (Megatron-Core's fetch from G5 and M2 on, the facade's conversion to pre-packed
samples before, the portable backend's microbatches); only where the generation table says padding reaches the model
(:attr:`~mcore_compat.generations.Generation.padding_reaches_model`, :attr:`Limits.padding_reaches_model`) are its
token ids checked like real ones. Every tensor is dense data
(strided, not on the meta device, not requiring grad). Extra keys are allowed and ignored. With virtual pipeline
stages ``data_iterator`` is a list of one iterator (or None) per stage, as Megatron-Core takes it
(:func:`stage_source`).

Nothing here raises for bad input: :func:`read_step` returns a problem record (see
:mod:`mcore_compat.problems`) that the caller ships inside the step's agreement collective,
so every rank raises the same error. Only torch is imported.
"""

from mcore_compat.contract.checks import bad_value, check_items, without_data
from mcore_compat.contract.conversion import convert_items
from mcore_compat.contract.reading import collection_paused, is_iterator, pull, read_step, stage_source
from mcore_compat.contract.schema import (
    LENGTH_KEYS,
    PACKED_KEYS,
    REQUIRED_SAMPLE_KEYS,
    SAMPLE_DTYPES,
    SAMPLE_FORMS,
    TOKEN_FIELDS,
    TOKEN_KEYS,
    Limits,
    LocalBatch,
    Sample,
    sample_form,
)

__all__ = [
    "LENGTH_KEYS",
    "PACKED_KEYS",
    "REQUIRED_SAMPLE_KEYS",
    "SAMPLE_DTYPES",
    "SAMPLE_FORMS",
    "TOKEN_FIELDS",
    "TOKEN_KEYS",
    "Limits",
    "LocalBatch",
    "Sample",
    "bad_value",
    "check_items",
    "collection_paused",
    "convert_items",
    "is_iterator",
    "pull",
    "read_step",
    "sample_form",
    "stage_source",
    "without_data",
]
