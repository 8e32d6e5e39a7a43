"""Packing problems as fixed-width integer records, so every rank can raise the same error.

A rank that finds bad input does not raise on its own: it encodes the problem as a
:data:`VERDICT_WIDTH`-int record, the record travels inside the collective the other ranks are
waiting in, and every rank then raises the same public error (:func:`error_for`):
:class:`~mcore_compat.errors.BadSampleError` for data, :class:`~mcore_compat.errors.PackingConfigError` for a
per-step argument or a setting. Each problem's message is one row of :data:`MESSAGES`. Both backends use it.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mcore_compat.errors import BadSampleError, PackingConfigError, PackingError, UnsupportedPinError

SAMPLE_KEYS: tuple[str, ...] = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "original_seq_len",
    "padded_seq_len",
    "cu_seqlens",
    "cu_seqlens_padded",
    "max_seqlen",
    "local_cp_size",
)
"""Keys a problem record can name, by index."""

COST_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "ffn_hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "gated_linear_unit",
)
"""The model sizes ``balanced`` derives each sample's modeled compute from (:mod:`mcore_compat.cost`)."""
SETTINGS_FIELDS: tuple[str, ...] = (
    "max_seqlen_per_dp_cp_rank",
    "sequence_packing_scheduler",
    "dynamic_context_parallel",
    "min_dynamic_context_parallel_size",
    "sequence_parallel",
    "virtual_pipeline_model_parallel_size",
    "microbatch_group_size_per_vp_stage",
    "thd_max_packed_sequences",
    "pad_packed_seq_alignment",
    "thd_tail_padding_policy",
    "cp_partition_mode",
    "pad_packed_seq_by_appending_dummy_seq",
    "mtp_num_layers",
    "pipeline_model_parallel_layout",
    *COST_FIELDS,
)
"""The model-config fields a packing step reads, compared between ranks in the agreement (by index): the MTP
layout decides which pipeline stages load data, the model's sizes how ``balanced`` weighs samples."""
_NUMERIC_SETTINGS = frozenset(
    {
        "max_seqlen_per_dp_cp_rank",
        "min_dynamic_context_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "microbatch_group_size_per_vp_stage",
        "thd_max_packed_sequences",
        *COST_FIELDS[:-1],
    }
)
"""Settings whose word is the value itself, so a message can show it (the others are a digest or a flag)."""

_COMMON_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
DTYPES: tuple[torch.dtype, ...] = _COMMON_DTYPES + tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)} - set(_COMMON_DTYPES), key=str)
)
"""Dtypes a problem record can name, by index: the common ones first, then every other dtype this torch defines
(complex, float8, unsigned, ...) by name; every rank of a job runs the same torch, so the indices agree."""

VERDICT_WIDTH = 6
"""``(code, rank, sample, a, b, c)``."""

NOT_AN_INT = -(1 << 62)
"""The word that stands for a value that is not an integer (or is a bool, or does not fit a word)."""


class Problem(enum.IntEnum):
    """What went wrong; 0 means nothing."""

    NONE = 0
    NO_ITERATOR = 1
    EXHAUSTED = 2
    ITERATOR_FAILED = 3
    BAD_ITEM = 4
    MIXED_FORMS = 5
    MISSING_KEY = 6
    BAD_DTYPE = 7
    BAD_SHAPE = 8
    LENGTH_MISMATCH = 9
    BAD_ORIGINAL = 10
    EMPTY_SAMPLE = 11
    MISALIGNED = 12
    OVERSIZE = 13
    TOO_FEW_SAMPLES = 14
    CP_MISMATCH = 15
    PACKED_EXHAUSTED = 16
    PACKED_MISSING_KEY = 17
    PACKED_NOT_A_DICT = 18
    BAD_LAYOUT = 19
    BAD_LENGTH = 20
    NOT_A_TENSOR = 21
    BAD_POSITION_IDS = 22
    MICROBATCH_MISMATCH = 23
    BAD_CU_SEQLENS = 24
    NO_DATA = 25
    CHECK_FAILED = 26
    BAD_NUM_MICROBATCHES = 27
    NOT_AN_ITERATOR = 28
    SETTINGS_MISMATCH = 29
    CONFIG_REFUSED = 30
    NOT_PER_STAGE = 31
    PACKED_NO_ITERATOR = 32
    PACKED_RAW_ITERATOR = 33
    PACKED_NOT_AN_ITERATOR = 34
    STAGE_ITERATOR_NONE = 35
    STAGE_MISMATCH = 36
    PACKED_UNREADABLE = 37
    LOSS_ON_PADDING = 38
    BAD_VALUE = 39


class TensorKind(enum.IntEnum):
    """Why a tensor field cannot be packed (word ``b`` of a ``NO_DATA`` record)."""

    META = 1
    LAYOUT = 2
    NESTED = 3
    REQUIRES_GRAD = 4
    SUBCLASS = 5
    UNALLOCATED = 6


REFUSAL_KINDS: tuple[type[PackingError], ...] = (PackingConfigError, UnsupportedPinError)
"""Errors a rank's own checks of its config raise before the agreement, by index (word ``sample`` of a
``CONFIG_REFUSED`` record): every rank raises the refusing rank's class with its message."""

CHECK_EXCEPTIONS: tuple[type[Exception], ...] = (
    TypeError,
    ValueError,
    RuntimeError,
    NotImplementedError,
    AttributeError,
    KeyError,
    IndexError,
    OverflowError,
)
"""Exceptions a ``CHECK_FAILED`` record can name, by index (word ``a``; anything else is 'an exception')."""


class LengthKind(enum.IntEnum):
    """What is wrong with a length field (word ``b`` of a ``BAD_LENGTH`` record; ``c`` carries the value)."""

    BOOL = 1
    PY_FLOAT = 2
    PY_INT = 3
    NOT_A_TENSOR = 4
    SHAPE = 5
    FLOAT_TENSOR = 16
    """Plus the index of the tensor's dtype in :data:`DTYPES`; ``c`` holds the float64 bits of the value."""


VALUE_TYPES: tuple[str, ...] = ("NoneType", "bool", "int", "float", "str", "list", "tuple", "dict", "numpy.ndarray")
"""Types a ``NOT_A_TENSOR`` record can name (word ``b``: index + 1; 0 for any other)."""


def value_type(value: object) -> int:
    """Word ``b`` of a ``NOT_A_TENSOR`` record for ``value``."""
    cls = type(value)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
    return VALUE_TYPES.index(name) + 1 if name in VALUE_TYPES else 0


class ItemKind(enum.IntEnum):
    """What a pulled item that is not a sample dict or a list of them is (word ``b`` of a ``BAD_ITEM`` record)."""

    OTHER = 0
    NONE = 1
    STRING = 2
    TUPLE = 3
    MAPPING = 4
    """A mapping that is not a dict (e.g. a ``UserDict`` such as Hugging Face's ``BatchEncoding``)."""
    EMPTY_LIST = 5
    LIST_OF_OTHER = 6
    TENSOR = 7


_ITEM_KINDS: dict[int, str] = {
    ItemKind.NONE: "None",
    ItemKind.STRING: "a string",
    ItemKind.TUPLE: "a tuple",
    ItemKind.MAPPING: "a mapping that is not a dict",
    ItemKind.EMPTY_LIST: "an empty list",
    ItemKind.LIST_OF_OTHER: "a list holding something other than dicts",
    ItemKind.TENSOR: "a tensor",
}
_ITEM_FIXES: dict[int, str] = {
    ItemKind.TUPLE: "yield a list of dicts instead of a tuple",
    ItemKind.MAPPING: "yield dict(item)",
}


def dtype_index(dtype: torch.dtype) -> int:
    """Index of ``dtype`` in :data:`DTYPES`, or -1."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def _dtype_name(index: int) -> str:
    return str(DTYPES[index]) if 0 <= index < len(DTYPES) else "another dtype"


def _key(index: int) -> str:
    return SAMPLE_KEYS[index] if 0 <= index < len(SAMPLE_KEYS) else f"key #{index}"


def _float(bits: int) -> str:
    value = struct.unpack("<d", struct.pack("<q", bits))[0]
    return "NaN" if math.isnan(value) else repr(value)


def _bad_length(key: str, kind: int, value: int) -> str:
    fix = "set it to an integer tensor of shape [1], e.g. torch.tensor([n], dtype=torch.int32)"
    if kind >= LengthKind.FLOAT_TENSOR:
        return f"{key!r} is a {_dtype_name(kind - LengthKind.FLOAT_TENSOR)} tensor holding {_float(value)}; {fix}"
    meanings: dict[int, str] = {
        LengthKind.BOOL: f"is a bool ({bool(value)})",
        LengthKind.PY_FLOAT: f"is a Python float ({_float(value)})",
        LengthKind.PY_INT: f"is a Python int ({value}), not a tensor",
        LengthKind.NOT_A_TENSOR: "is not a tensor",
        LengthKind.SHAPE: f"is a tensor with {value} dimension(s) or more than one element",
    }
    what = meanings.get(kind, "is not an integer length")
    return f"{key!r} {what}; {fix}"


def _bad_value(key: str, at: int, value: int) -> str:
    if key == "tokens":
        return (
            f"tokens[{at}]={value} is negative; the embedding reads every real token (and every padding slot on a "
            "pin whose fetch does not overwrite padding), and with tensor parallelism a negative id silently becomes "
            "a zero vector: use vocabulary ids >= 0 (mark ignored positions in labels/loss_mask, not in tokens)"
        )
    return (
        f"{key}[{at}]={value} is negative where loss_mask[{at}] is not 0, so it is trained on, and Megatron-Core's "
        "cross entropy takes a target outside the vocabulary as a zero logit (a silently wrong loss); set loss_mask "
        "to 0 wherever labels hold an ignore index such as -100"
    )


_BOUNDS_PROBLEMS = {
    0: "is not a 1-D integer tensor with at least two entries",
    1: "does not start at 0 (it starts at {c})",
    2: "decreases at entry {c}",
    3: "has a different number of entries than cu_seqlens (difference {c})",
    4: "marks no sequence (it ends at {c}): every sample needs at least one token (drop empty samples)",
}


TENSOR_KINDS: dict[int, str] = {
    TensorKind.META: "a meta-device tensor (it holds no data)",
    TensorKind.LAYOUT: "a tensor that is not dense (its layout is not torch.strided, e.g. sparse)",
    TensorKind.NESTED: "a nested tensor",
    TensorKind.REQUIRES_GRAD: "a tensor that requires grad (part of an autograd graph)",
    TensorKind.SUBCLASS: "a torch.Tensor subclass (e.g. a MaskedTensor), which packing cannot concatenate or send",
    TensorKind.UNALLOCATED: (
        "a tensor whose storage does not hold its elements (freed, e.g. by untyped_storage().resize_(0), or shrunk)"
    ),
}


def exception_index(exc: BaseException) -> int:
    """Index of the first class in :data:`CHECK_EXCEPTIONS` that ``exc`` is an instance of, or -1."""
    return next((i for i, kind in enumerate(CHECK_EXCEPTIONS) if isinstance(exc, kind)), -1)


class Record(NamedTuple):
    """One decoded problem record: what, where (DP rank, sample of the step) and three words of detail."""

    code: int
    rank: int
    sample: int
    a: int
    b: int
    c: int

    @property
    def where(self) -> str:
        return f"DP rank {self.rank}, sample {self.sample} of this step"


_WAIT_FOR_PACKED = "pass the iterator returned by wrap_data_iterator_for_global_batch_packing"


def _no_iterator(r: Record) -> str:
    return (
        f"data_iterator=None on DP rank {r.rank}, a rank that loads data (TP rank 0 of a data-owning pipeline "
        "stage: the first, the last, and one holding multi-token-prediction layers); pass the raw sample iterator "
        "there and None only on the other TP ranks"
    )


def _not_an_iterator(r: Record) -> str:
    return (
        f"data_iterator on DP rank {r.rank} is not an iterator (it has no __next__: e.g. a list or a DataLoader); "
        "pass iter(...) of it"
    )


def _not_per_stage(r: Record) -> str:
    given = "not a list" if r.a < 0 else f"a list of {r.a}"
    return (
        f"data_iterator on DP rank {r.rank} is {given} with virtual_pipeline_model_parallel_size={r.b}; pass a list "
        f"of {r.b}, one iterator per virtual pipeline stage (None for a stage that loads no data)"
    )


def _stage_iterator_none(r: Record) -> str:
    stage = "first" if r.a == 0 else "last"
    return (
        f"data_iterator[{r.a}] is None on DP rank {r.rank}, TP rank 0 of the {stage} pipeline stage, with "
        f"virtual_pipeline_model_parallel_size={r.b}: this pin's scheduler pulls the step's samples from "
        "data_iterator[0] on the first pipeline stage and data_iterator[-1] on the last; pass the sample "
        f"iterator at data_iterator[{r.a}]"
    )


def _exhausted(r: Record) -> str:
    if r.c == RAN_OUT_BETWEEN_STEPS:
        return (
            "data_iterator is exhausted on every data-loading rank (no samples left for this step); "
            "stop the loop here or size the loader for more steps"
        )
    if r.c == RAN_OUT_WITHIN_STEP:
        return (
            f"data_iterator ran out on every data-loading rank partway through this step (DP rank {r.rank} after "
            f"{r.a} of num_microbatches={r.b} items): the loader does not hold a whole step; size it to a whole "
            "number of steps (drop the last partial global batch) or lower num_microbatches"
        )
    return (
        f"data_iterator on DP rank {r.rank} raised StopIteration after {r.a} of num_microbatches={r.b} items "
        "while other ranks still had data; every data-loading rank must yield num_microbatches items per "
        "step (size the loader for all steps)"
    )


def _iterator_failed(r: Record) -> str:
    return (
        f"data_iterator on DP rank {r.rank} raised an exception while producing item {r.a}; "
        "see the chained traceback on that rank and fix the dataset or collate function"
    )


def _bad_item(r: Record) -> str:
    what = _ITEM_KINDS.get(r.b, "another object")
    fix = _ITEM_FIXES.get(r.b, "use an identity collate so each next() yields one dict or a list of dicts")
    return (
        f"item {r.a} from data_iterator on DP rank {r.rank} is {what}, neither a sample dict nor a list of sample "
        f"dicts; {fix}"
    )


def _mixed_forms(r: Record) -> str:
    return (
        f"{r.where} mixes sample forms: every sample of a step must carry either 'padded_seq_len' "
        "(unpacked) or 'cu_seqlens' (pre-packed), and exactly one of them"
    )


def _missing_key(r: Record) -> str:
    return (
        f"{r.where} has no {_key(r.a)!r}; unpacked samples need tokens, labels, loss_mask, position_ids and "
        "padded_seq_len (original_seq_len defaults to it), pre-packed ones cu_seqlens instead of the lengths"
    )


def _not_a_tensor(r: Record) -> str:
    what = f"a {VALUE_TYPES[r.b - 1]}" if 1 <= r.b <= len(VALUE_TYPES) else "not a torch.Tensor"
    hint = "torch.from_numpy(...)" if what == "a numpy.ndarray" else "torch.tensor(...)"
    return f"{r.where}: {_key(r.a)!r} is {what}; pass every per-token field as a 1-D torch.Tensor (e.g. {hint} of it)"


def _bad_position_ids(r: Record) -> str:
    return (
        f"{r.where}: position_ids[{r.a}]={r.b} but a sequence's real tokens must have position_ids 0..{r.c - 1}; "
        "set position_ids to torch.arange(L) (per sequence in pre-packed samples)"
    )


def _loss_on_padding(r: Record) -> str:
    return (
        f"{r.where}: loss_mask[{r.a}]={_float(r.b)} lies in the sequence's padding (past original_seq_len={r.c}), "
        "where Megatron-Core trains on nothing (it masks padding out, so real tokens there are silently dropped); put "
        "the real tokens first (right padding) and set loss_mask to 0 on padding, as "
        "packing.global_batch.build_unpacked_sequence_sample does"
    )


def _microbatch_mismatch(r: Record) -> str:
    return (
        f"num_microbatches differs between ranks: global rank {r.a} (DP rank {r.rank}) passed {r.b}, global rank 0 "
        f"passed {r.c}; pass the same num_microbatches (get_num_microbatches()) on every rank"
    )


def _bad_num_microbatches(r: Record) -> str:
    value = "num_microbatches is not an int" if r.b == NOT_AN_INT else f"num_microbatches={r.b}"
    return (
        f"{value} on global rank {r.a} (DP rank {r.rank}); pass the positive int number of samples each "
        "data-parallel rank pulls this step (get_num_microbatches()), the same on every rank"
    )


def _settings_mismatch(r: Record) -> str:
    name = SETTINGS_FIELDS[r.sample] if 0 <= r.sample < len(SETTINGS_FIELDS) else "a packing setting"
    values = f" ({r.b} there, {r.c} on global rank 0)" if name in _NUMERIC_SETTINGS else ""
    return (
        f"model_config.{name} differs between ranks: global rank {r.a} (DP rank {r.rank}) has another value than "
        f"global rank 0{values}; set it identically on every rank (build one model config the same way "
        "everywhere)"
    )


def _config_refused(r: Record) -> str:
    return (
        f"the packing settings of global rank {r.a} (DP rank {r.rank}) were refused there; the message travels "
        "after the agreement (mcore_compat.agreement)"
    )


def _bad_cu_seqlens(r: Record) -> str:
    detail = _BOUNDS_PROBLEMS.get(r.b, "is invalid").format(c=r.c)
    return (
        f"{r.where}: {_key(r.a)!r} {detail}; pre-packed samples need cu_seqlens (and optionally cu_seqlens_padded) "
        "as 1-D integer tensors from 0 to the token count, never decreasing"
    )


def _no_data(r: Record) -> str:
    what = TENSOR_KINDS.get(r.b, "a tensor that cannot be packed")
    if r.b == TensorKind.REQUIRES_GRAD:
        return f"{r.where}: {_key(r.a)!r} is {what}; build samples from data, e.g. pass {_key(r.a)}.detach()"
    return (
        f"{r.where}: {_key(r.a)!r} is {what}; pass every field as a dense tensor with data "
        "(a plain torch.Tensor, torch.strided layout, on the CPU or the GPU)"
    )


def _check_failed(r: Record) -> str:
    raised = CHECK_EXCEPTIONS[r.a].__name__ if 0 <= r.a < len(CHECK_EXCEPTIONS) else "an exception"
    return (
        f"{r.where} could not be checked against the data contract (checking it raised {raised}; the chained "
        f"traceback on DP rank {r.rank} shows where); pass a dict of 1-D dense tensors as the data contract "
        "describes (mcore_compat.contract)"
    )


def _bad_dtype(r: Record) -> str:
    return (
        f"{r.where}: {_key(r.a)!r} has dtype {_dtype_name(r.b)}; the data contract requires "
        f"{_dtype_name(r.c)} (cast it when building the sample)"
    )


def _bad_shape(r: Record) -> str:
    shape = "is a 0-d tensor (one value)" if r.b == 0 else f"has {r.b} dimensions (shape [{r.c}, ...])"
    return (
        f"{r.where}: {_key(r.a)!r} {shape}; per-token fields must be 1-D "
        "(or [1, L] from a default collate with micro-batch size 1)"
    )


def _length_mismatch(r: Record) -> str:
    return (
        f"{r.where}: {_key(r.a)!r} holds {r.b} tokens but the sample's padded length is {r.c}; "
        "per-token fields must have padded_seq_len elements"
    )


def _bad_original(r: Record) -> str:
    return (
        f"{r.where}: original_seq_len={r.a} is outside [1, padded_seq_len={r.b}]; set original_seq_len to the "
        "real token count before padding (at least 1, at most padded_seq_len)"
    )


def _misaligned(r: Record) -> str:
    return (
        f"{r.where}: padded_seq_len={r.a} is not a multiple of {r.b} (the alignment multiple of this layout, "
        f"packing.global_batch.alignment_multiple), which the THD zigzag split needs; pad samples to a "
        f"multiple of {r.b}"
    )


def _oversize(r: Record) -> str:
    return (
        f"{r.where}: padded_seq_len={r.b} exceeds the bin capacity {r.c} (max_seqlen_per_dp_cp_rank x the "
        "context-parallel size, x the data-parallel size with dynamic CP); truncate the sample or raise "
        "max_seqlen_per_dp_cp_rank"
    )


_TOO_FEW_SAMPLES: dict[int, str] = {
    -3: (
        "Megatron-Core's dp_balanced could not round its bin count up to a multiple of {c} (data-parallel "
        "size, x microbatch_group_size_per_vp_stage with VPP): too few of its bins hold two or more sequences "
        "to split off ('Not enough samples to move'); use more samples per step (num_microbatches)"
    ),
    -2: (
        "the global batch's {a} sequences all fit in one bin, but Megatron-Core's dp_balanced needs a multiple "
        "of {c} bins (data-parallel size, x microbatch_group_size_per_vp_stage with VPP) and this pin never "
        "splits its first bin (it would fail with 'Not enough samples to move'); use more or longer samples per "
        "step (num_microbatches), or a smaller data-parallel size for such steps"
    ),
    -1: (
        "the global batch has {a} sequences, but Megatron-Core's dp_balanced needs at least {c} bins of one "
        "sequence or more (data-parallel size x microbatch_group_size_per_vp_stage); use more samples per step "
        "(num_microbatches) or a smaller microbatch_group_size_per_vp_stage"
    ),
    0: (
        "the global batch has {a} samples packed into {b} bins, but dp_balanced needs the bin count to be "
        "a multiple of {c} (data-parallel size x VPP microbatch group) and can only split bins with more than "
        "one sample; use more samples per step"
    ),
}
"""Word ``b`` of a ``TOO_FEW_SAMPLES`` record: -3, -2 (Megatron-Core's own rounding) or any other negative value,
else the bin count."""


def _too_few_samples(r: Record) -> str:
    variant = r.b if r.b in (-3, -2) else -1 if r.b < 0 else 0
    return _TOO_FEW_SAMPLES[variant].format(a=r.a, b=r.b, c=r.c)


def _cp_mismatch(r: Record) -> str:
    what = "samples of the same lengths whose tokens, labels or loss mask differ" if r.c else "different samples"
    return (
        f"context-parallel siblings disagree: ranks {r.a} and {r.b} (same DP rank {r.rank}) received {what}; "
        "feed CP siblings identical data (select samples by DP rank only, with the same seed for any "
        "random masking or augmentation)"
    )


def _stage_mismatch(r: Record) -> str:
    return (
        f"pipeline stages disagree: ranks {r.a} and {r.b} (DP rank {r.rank}; rank {r.b} on pipeline stage {r.c}) "
        "pulled different samples, so one stage's tokens would meet another's labels; feed every pipeline stage "
        "that loads data the same samples in the same order for its DP rank (seed and shard by DP rank only)"
    )


def _packed_exhausted(r: Record) -> str:
    if r.a < 0:
        return (
            "the data_iterator given to get_batch_for_global_batch_packing on TP rank 0 ran out before the "
            "microbatch count wrap_data_iterator_for_global_batch_packing returned for this step; pass the packed "
            "iterator it returned for this step"
        )
    return (
        f"the packed iterator is exhausted: get_batch was called more often than the microbatch count "
        f"wrap returned{f' ({r.a})' if r.a else ''}; use that count (packed_num_microbatches) for the step"
    )


def _packed_missing_key(r: Record) -> str:
    lacks = (
        "a key this stage's fetch reads (cu_seqlens, cu_seqlens_padded, max_seqlen; tokens and position_ids on the "
        "first stage, labels and loss_mask on the last; local_cp_size under dynamic CP)"
        if r.a < 0
        else repr(_key(r.a))
    )
    return (
        f"the data_iterator given to get_batch_for_global_batch_packing yielded a dict without {lacks}, so not a "
        f"packed microbatch (e.g. a collated batch); {_WAIT_FOR_PACKED}"
    )


def _packed_not_an_iterator(r: Record) -> str:
    return (
        "get_batch_for_global_batch_packing got a data_iterator on TP rank 0 that is not an iterator (it has no "
        "__next__: e.g. a list, such as the list of every virtual stage's packed iterators); pass the packed "
        "iterator, with virtual pipeline stages the one at index vp_stage of the list wrap returned"
    )


def _bad_layout(r: Record) -> str:
    return (
        f"pg_collection does not describe a DP x CP grid: the DP x CP group holds {r.a} ranks but the DP group "
        f"has {r.b} and the CP group {r.c}; pass the model's ProcessGroupCollection (dp, cp, dp_cp from one layout)"
    )


def _fixed(text: str) -> Callable[[Record], str]:
    return lambda r: text


MESSAGES: dict[Problem, Callable[[Record], str]] = {
    Problem.NO_ITERATOR: _no_iterator,
    Problem.NOT_AN_ITERATOR: _not_an_iterator,
    Problem.NOT_PER_STAGE: _not_per_stage,
    Problem.STAGE_ITERATOR_NONE: _stage_iterator_none,
    Problem.EXHAUSTED: _exhausted,
    Problem.ITERATOR_FAILED: _iterator_failed,
    Problem.BAD_ITEM: _bad_item,
    Problem.MIXED_FORMS: _mixed_forms,
    Problem.MISSING_KEY: _missing_key,
    Problem.NOT_A_TENSOR: _not_a_tensor,
    Problem.BAD_LENGTH: lambda r: f"{r.where}: {_bad_length(_key(r.a), r.b, r.c)}",
    Problem.BAD_POSITION_IDS: _bad_position_ids,
    Problem.LOSS_ON_PADDING: _loss_on_padding,
    Problem.BAD_VALUE: lambda r: f"{r.where}: {_bad_value(_key(r.a), r.b, r.c)}",
    Problem.MICROBATCH_MISMATCH: _microbatch_mismatch,
    Problem.BAD_NUM_MICROBATCHES: _bad_num_microbatches,
    Problem.SETTINGS_MISMATCH: _settings_mismatch,
    Problem.CONFIG_REFUSED: _config_refused,
    Problem.BAD_CU_SEQLENS: _bad_cu_seqlens,
    Problem.NO_DATA: _no_data,
    Problem.CHECK_FAILED: _check_failed,
    Problem.BAD_DTYPE: _bad_dtype,
    Problem.BAD_SHAPE: _bad_shape,
    Problem.LENGTH_MISMATCH: _length_mismatch,
    Problem.BAD_ORIGINAL: _bad_original,
    Problem.EMPTY_SAMPLE: lambda r: (
        f"{r.where}: padded_seq_len={r.a}; every sample needs at least one token (drop empty samples)"
    ),
    Problem.MISALIGNED: _misaligned,
    Problem.OVERSIZE: _oversize,
    Problem.TOO_FEW_SAMPLES: _too_few_samples,
    Problem.CP_MISMATCH: _cp_mismatch,
    Problem.STAGE_MISMATCH: _stage_mismatch,
    Problem.PACKED_EXHAUSTED: _packed_exhausted,
    Problem.PACKED_MISSING_KEY: _packed_missing_key,
    Problem.PACKED_NO_ITERATOR: _fixed(
        "get_batch_for_global_batch_packing got data_iterator=None on TP rank 0, where "
        "wrap_data_iterator_for_global_batch_packing returned the packed iterator; pass that iterator"
    ),
    Problem.PACKED_RAW_ITERATOR: _fixed(
        "get_batch_for_global_batch_packing got the sample iterator that "
        "wrap_data_iterator_for_global_batch_packing consumed, not the packed iterator it returned; pass the "
        "returned one (packed_iterator)"
    ),
    Problem.PACKED_NOT_AN_ITERATOR: _packed_not_an_iterator,
    Problem.PACKED_NOT_A_DICT: _fixed(
        f"the packed iterator yielded something other than a microbatch dict; {_WAIT_FOR_PACKED}"
    ),
    Problem.PACKED_UNREADABLE: _fixed(
        "get_batch_for_global_batch_packing could not read the next packed microbatch on TP rank 0 (its "
        f"data_iterator raised; the chained traceback on that rank shows what); {_WAIT_FOR_PACKED}"
    ),
    Problem.BAD_LAYOUT: _bad_layout,
}
"""The message of every problem, one row each (a test checks every :class:`Problem` but ``NONE`` has one)."""


def describe(record: Sequence[int]) -> str:
    """The message for one problem record ``(code, rank, sample, a, b, c)``."""
    decoded = Record(*(int(v) for v in record))
    message = MESSAGES.get(Problem(decoded.code))
    return f"no problem (code {decoded.code})" if message is None else message(decoded)


_WORD_MIN, _WORD_MAX = -(1 << 63), (1 << 63) - 1


def record(problem: Problem, rank: int = -1, sample: int = -1, a: int = 0, b: int = 0, c: int = 0) -> list[int]:
    """Encode one problem; a value beyond a 64-bit word (a length of 2**64 - 1 in a uint64 tensor) is clamped
    to the nearest word, so that the record always travels."""
    return [int(problem), rank, sample, *(min(max(int(w), _WORD_MIN), _WORD_MAX) for w in (a, b, c))]


OK: list[int] = record(Problem.NONE)


CONFIG_PROBLEMS = frozenset({Problem.BAD_NUM_MICROBATCHES, Problem.MICROBATCH_MISMATCH, Problem.SETTINGS_MISMATCH})
"""Problems with the trainer's per-step argument or its config: raised as :class:`PackingConfigError`; every other
problem is a :class:`BadSampleError`."""


def error_for(verdict: Sequence[int]) -> PackingError:
    """The public error every rank raises for an agreed problem record, carrying the record (``.verdict``)."""
    words = tuple(int(v) for v in verdict)
    cls = PackingConfigError if words[0] in CONFIG_PROBLEMS else BadSampleError
    error = cls(describe(words))
    error.verdict = words
    return error


RAN_OUT_BETWEEN_STEPS, RAN_OUT_WITHIN_STEP = 1, 2
"""Word ``c`` of an agreed ``EXHAUSTED`` verdict: every data-loading rank ran out before its first item (the
data ended between steps: ``StopIteration``), or every one ran out partway through the step (an error)."""


def ran_out(problems: Sequence[Sequence[int]], loading: int) -> list[int] | None:
    """The agreed verdict when the data ran out on all ``loading`` data-loading ranks (``problems``: theirs),
    or None when some rank had another problem or none (its own record then speaks)."""
    if not problems or len(problems) != loading or any(p[0] != Problem.EXHAUSTED for p in problems):
        return None
    if all(p[3] == 0 for p in problems):
        return record(Problem.EXHAUSTED, c=RAN_OUT_BETWEEN_STEPS)
    first = problems[0]
    return record(Problem.EXHAUSTED, first[1], a=first[3], b=first[4], c=RAN_OUT_WITHIN_STEP)


def raise_if_bad(verdict: Sequence[int], cause: BaseException | None = None) -> None:
    """Raise for a bad verdict: ``StopIteration`` when every rank's data ran out together or a fetch came after
    the last packed microbatch, else the packing error."""
    if int(verdict[0]) == Problem.NONE:
        return
    error = error_for(verdict)
    ended = verdict[0] == Problem.EXHAUSTED and int(verdict[5]) == RAN_OUT_BETWEEN_STEPS
    if ended or verdict[0] == Problem.PACKED_EXHAUSTED:
        raise StopIteration(str(error)) from cause
    raise error from cause


__all__ = [
    "CHECK_EXCEPTIONS",
    "CONFIG_PROBLEMS",
    "DTYPES",
    "ItemKind",
    "VALUE_TYPES",
    "NOT_AN_INT",
    "OK",
    "MESSAGES",
    "Record",
    "Problem",
    "RAN_OUT_BETWEEN_STEPS",
    "RAN_OUT_WITHIN_STEP",
    "REFUSAL_KINDS",
    "SAMPLE_KEYS",
    "SETTINGS_FIELDS",
    "TENSOR_KINDS",
    "TensorKind",
    "VERDICT_WIDTH",
    "describe",
    "dtype_index",
    "error_for",
    "exception_index",
    "raise_if_bad",
    "ran_out",
    "value_type",
    "record",
]
