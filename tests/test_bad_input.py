"""Bad input raises the same clear error on every rank, within seconds, on the native and portable backends.

Runs on whichever Megatron-Core the session has (``$MCORE_SRC``: a dev or main tree, native
scheduler; else the installed release: portable backend). One gloo process group of 4 ranks per
layout plays every case; the collective timeout is short, so a rank left inside a collective fails the
whole run (with every rank's stack) instead of passing. Heavy: run under the shared lock.
"""

from __future__ import annotations

import pytest

from mcore_compat.generations import GENERATIONS
from mcore_compat.rules import STEP_FIELDS
from mcore_compat.testing import Layout, launch, locate_mcore
from tests.bad_input_ranks import BadInput, bad_inputs_on_rank, random_settings
from tests.claims import refused

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

LAYOUTS = ((Layout(1, 2, 2), 1), (Layout(1, 1, 4), 1), (Layout(2, 1, 2), 1), (Layout(1, 1, 2), 3))
"""Each layout with its pipeline stages: three give a middle stage, which loads no data on some generations."""
PIPELINE_REFUSES_DYNAMIC_CP = "dynamic context parallelism runs without pipeline parallelism"
BASE = {"num_microbatches": 4, "max_seqlen_per_dp_cp_rank": 32}
_VPP_GROUP = ("virtual_pipeline_model_parallel_size", 1), ("microbatch_group_size_per_vp_stage", 4)
VPP_4 = _VPP_GROUP
VPP_3 = (_VPP_GROUP[0], ("microbatch_group_size_per_vp_stage", 3))
VPP_1 = (_VPP_GROUP[0], ("microbatch_group_size_per_vp_stage", 1))
"""One virtual stage (no list of iterators needed) with a microbatch group: Megatron-Core still rounds its bins
up to a multiple of DP x the group."""
"""Layouts where every rank is a TP rank 0: a fetch given the wrong iterator is seen on every rank (with TP > 1
Megatron-Core's other TP ranks cannot tell, and wait in its broadcast; the portable backend raises on all)."""
SECONDS = 10.0
DYNAMIC = (("dynamic_context_parallel", True), ("sequence_packing_scheduler", "default_dynamic_cp"))

STATIC_THD = (("pad_packed_seq_alignment", 8), ("thd_max_packed_sequences", 8))
"""THD padding to a multiple and a static sequence capacity (as for CUDA graphs): Megatron-Core's fetch replaces
``max_seqlen``."""
STATIC_THD_MAX = (
    ("pad_packed_seq_alignment", "max"),
    ("thd_max_packed_sequences", 8),
    ("thd_tail_padding_policy", "extend_last"),
)
"""The same, padded to ``max_seqlen_per_dp_cp_rank`` with the tail added to the last sequence."""

PAD_IDS = (0, -1, -100, 2**40)
"""Ids in every padding slot (tokens, labels, position ids) of every sample: what real pipelines pad with. Every pin
writes 0 over padding before the model reads it, so each step fetches the microbatches of zero padding."""

BAD = "BadSampleError"
CONFIG = "PackingConfigError"
FIRST_BIN = "refused where dp_balanced never splits its first bin"
"""A good step that Megatron-Core's dp_balanced cannot round where its first bin never donates (main): refused
on every rank (BAD) there; packed everywhere else."""
STAGES = "refused where there are pipeline stages"
"""A defect on one pipeline stage only: BAD with the case's fragments where the layout has pipeline stages (they load
different samples for one DP rank); with one stage it hits every rank of that DP rank alike, and the step packs."""
PIPELINE_CONFIG = "a config error where there are pipeline stages"
"""A setting only pipeline stages need: CONFIG with the case's fragments where the layout has pipeline stages, else
the step packs."""
PADDED = "refused where the backend does not pad packed microbatches"
RERUN = "packs again where the pin's rerun iterator replays unedited microbatches or TP > 1 (the facade hands a copy)"
"""A bad input under THD padding (``pad_packed_seq_alignment``): the portable backend refuses the setting on every
rank (naming it); where Megatron-Core's fetch pads, BAD with the case's fragments."""

# (case, expected: BAD / CONFIG / "StopIteration" / "ValueError" / "ok", fragments every message must hold)
CASES: list[tuple[BadInput, str, tuple[str, ...]]] = [
    (BadInput("missing key", "drop_labels"), BAD, ("DP rank 1", "sample 1", "'labels'", "need")),
    (BadInput("missing lengths", "drop_lengths", dp_rank=0), BAD, ("DP rank 0", "'padded_seq_len'")),
    (BadInput("tokens/labels mismatch", "short_labels"), BAD, ("'labels' holds", "padded length")),
    (BadInput("lying padded length", "lying_padded"), BAD, ("'tokens' holds", "padded length")),
    (BadInput("negative original", "negative_original"), BAD, ("original_seq_len=-3", "real token count")),
    (BadInput("negative padded", "negative_padded", dp_rank=1), BAD, ("padded_seq_len=-4", "drop empty")),
    (BadInput("original above padded", "original_above_padded"), BAD, ("original_seq_len=", "at most padded")),
    (BadInput("original zero", "original_zero", index=0), BAD, ("original_seq_len=0", "at least 1")),
    (BadInput("NaN length", "nan_length"), BAD, ("'padded_seq_len'", "NaN", "integer tensor")),
    (BadInput("float length", "float_length"), BAD, ("'padded_seq_len'", "torch.float32", "integer tensor")),
    (BadInput("float original", "float_original"), BAD, ("'original_seq_len'", "integer tensor")),
    (BadInput("python int length", "python_int_length"), BAD, ("Python int", "shape [1]")),
    (BadInput("0-d length", "scalar_length"), BAD, ("'padded_seq_len'", "shape [1]")),
    (BadInput("two-element length", "two_lengths"), BAD, ("'padded_seq_len'", "shape [1]")),
    (BadInput("bool length", "bool_length"), BAD, ("'padded_seq_len'", "integer tensor")),
    (BadInput("non-dict item", "string", index=2), BAD, ("item 2", "DP rank 1", "is a string", "identity collate")),
    (BadInput("None item", "none_item", dp_rank=0, index=0), BAD, ("item 0", "DP rank 0", "is None")),
    (BadInput("empty list item", "empty_list"), BAD, ("item 1", "an empty list", "list of dicts")),
    (BadInput("list with a string", "list_with_string"), BAD, ("item 1", "other than dicts")),
    (BadInput("a mapping that is not a dict", "user_dict"), BAD, ("item 1", "not a dict", "dict(item)")),
    (BadInput("tokens int32", "tokens_int32"), BAD, ("'tokens'", "torch.int32", "torch.int64")),
    (BadInput("loss_mask bool", "loss_mask_bool"), BAD, ("'loss_mask'", "torch.bool", "torch.float32")),
    (BadInput("tokens a list", "tokens_list"), BAD, ("'tokens' is a list", "torch.tensor(...)")),
    (BadInput("tokens 2-D", "tokens_2d"), BAD, ("'tokens'", "dimensions", "1-D")),
    (BadInput("tokens on the meta device", "tokens_meta"), BAD, ("'tokens'", "meta-device", "dense tensor")),
    (BadInput("sparse loss_mask", "loss_mask_sparse", index=0), BAD, ("'loss_mask'", "not dense", "sample 0")),
    (BadInput("sample that fails to decode", "undecodable"), BAD, ("sample 1", "raised RuntimeError", "dict of")),
    (BadInput("loss_mask a MaskedTensor", "masked_loss_mask"), BAD, ("'loss_mask'", "torch.Tensor subclass", "plain")),
    (BadInput("labels a tensor subclass", "subclass_labels"), BAD, ("sample 1", "'labels'", "torch.Tensor subclass")),
    (BadInput("an item that fails to load", "lazy_list"), BAD, ("DP rank 1", "sample 1", "could not be checked")),
    (
        BadInput("uint64 padded length 2**64 - 1", "uint64_padded_max"),
        BAD,
        ("DP rank 1", "sample 1", "padded length is 9223372036854775807"),
    ),
    (
        BadInput("uint64 original length 2**63", "uint64_original_2_63"),
        BAD,
        ("DP rank 1", "sample 1", "original_seq_len=9223372036854775807"),
    ),
    (BadInput("quantized padded length", "quantized_padded"), BAD, ("'padded_seq_len'", "torch.qint32", "integer")),
    (
        BadInput("tokens differ on one CP sibling", "other_tokens", cp_rank=1, layouts=("1x2x2",)),
        BAD,
        ("context-parallel siblings disagree", "DP rank 1", "tokens, labels or loss mask differ", "same seed"),
    ),
    (
        BadInput("one loss-mask entry differs on one CP sibling", "one_token_unmasked", cp_rank=0, layouts=("1x2x2",)),
        BAD,
        ("context-parallel siblings disagree", "tokens, labels or loss mask differ"),
    ),
    (BadInput("negative token id", "negative_token"), BAD, ("DP rank 1", "sample 1", "tokens[0]=-1", "ids >= 0")),
    *((BadInput(f"padding ids {pad}", f"pad_ids:{pad}", index=-1, dp_rank=None), "ok", ()) for pad in PAD_IDS),
    (BadInput("padding ids -100, dynamic CP", "pad_ids:-100", index=-1, dp_rank=None, dynamic_cp=True), "ok", ()),
    (BadInput("padding ids 0, dynamic CP", "pad_ids:0", index=-1, dp_rank=None, dynamic_cp=True), "ok", ()),
    (
        BadInput("label -100 trained on", "ignore_label_trained", index=0),
        BAD,
        ("sample 0", "labels[0]=-100", "loss_mask[0] is not 0", "set loss_mask to 0"),
    ),
    (BadInput("labels -100 where loss_mask is 0", "ignore_label_untrained", index=-1), "ok", ()),
    (BadInput("padded length on the meta device", "padded_meta"), BAD, ("'padded_seq_len'", "meta-device")),
    (BadInput("tokens with a freed storage", "tokens_freed"), BAD, ("'tokens'", "storage does not hold", "dense")),
    (BadInput("loss_mask with a shrunk storage", "loss_mask_shrunk"), BAD, ("'loss_mask'", "storage does not hold")),
    (BadInput("padded length with a freed storage", "padded_freed"), BAD, ("'padded_seq_len'", "storage does not")),
    (BadInput("original length on the meta device", "original_meta"), BAD, ("'original_seq_len'", "meta-device")),
    (BadInput("zero position_ids", "zero_positions"), BAD, ("position_ids[1]=0", "torch.arange")),
    (BadInput("shifted position_ids", "shifted_positions", dp_rank=0), BAD, ("position_ids[0]=1", "DP rank 0")),
    (BadInput("left-padded sample", "left_padded"), BAD, ("sample 1", "loss_mask[", "in the sequence's padding")),
    (BadInput("both forms", "both_forms"), BAD, ("mixes sample forms", "exactly one")),
    (BadInput("forms mixed within a rank", "prepacked", index=2), BAD, ("sample 2", "mixes sample forms")),
    (BadInput("pre-packed on one rank, unpacked on the others", "prepacked", index=-1), "ok", ()),
    (
        BadInput("cu_seqlens decreasing", "cu_decreasing", index=-1),
        BAD,
        ("'cu_seqlens'", "decreases", "never decreasing"),
    ),
    (BadInput("oversize on one rank", "oversize", dp_rank=0, index=3), BAD, ("exceeds the bin capacity", "sample 3")),
    (
        BadInput("misaligned", "misaligned", layouts=("1x2x2",)),
        BAD,
        ("padded_seq_len=63", "not a multiple of 4", "pad samples"),
    ),
    (BadInput("one rank exhausted", "exhausted", index=2), BAD, ("DP rank 1", "StopIteration after 2", "size the")),
    (BadInput("every rank exhausted", "exhausted", dp_rank=None, index=0), "StopIteration", ("exhausted on every",)),
    (BadInput("a list, not an iterator", "list", dp_rank=0), BAD, ("DP rank 0", "not an iterator", "iter(")),
    (BadInput("iterator raises", "raising", dp_rank=0, index=1), BAD, ("DP rank 0", "raised an exception", "fix")),
    (
        BadInput("iterator cancelled (a BaseException)", "cancelled", dp_rank=0, index=2),
        BAD,
        ("DP rank 0", "raised an exception while producing item 2"),
    ),
    (BadInput("num_microbatches differs", num_microbatches=3), CONFIG, ("num_microbatches differs", "passed 3")),
    (BadInput("num_microbatches zero", num_microbatches=0, dp_rank=None), CONFIG, ("num_microbatches=0",)),
    (
        BadInput("num_microbatches zero on one rank", num_microbatches=0),
        CONFIG,
        ("num_microbatches=0", "DP rank 1", "same on every rank"),
    ),
    (
        BadInput("num_microbatches a float on one rank", num_microbatches=4.0, dp_rank=0),
        CONFIG,
        ("num_microbatches is not an int", "DP rank 0"),
    ),
    (
        BadInput("num_microbatches differs, dynamic CP", num_microbatches=3, dynamic_cp=True),
        CONFIG,
        ("num_microbatches differs", "passed 3"),
    ),
    (
        BadInput("num_microbatches zero on one rank, dynamic CP", num_microbatches=0, dp_rank=0, dynamic_cp=True),
        CONFIG,
        ("num_microbatches=0", "DP rank 0"),
    ),
    (BadInput("missing key, dynamic CP", "drop_labels", dynamic_cp=True), BAD, ("DP rank 1", "'labels'")),
    (BadInput("tokens on the meta device, dynamic CP", "tokens_meta", dynamic_cp=True), BAD, ("'tokens'", "meta")),
    (BadInput("tokens freed, dynamic CP", "tokens_freed", dynamic_cp=True), BAD, ("'tokens'", "storage does not")),
    (
        BadInput("capacity None", config=(("max_seqlen_per_dp_cp_rank", None),)),
        CONFIG,
        ("max_seqlen_per_dp_cp_rank=None",),
    ),
    (BadInput("capacity float", config=(("max_seqlen_per_dp_cp_rank", 32.0),)), CONFIG, ("=32.0", "positive int")),
    (
        BadInput("dynamic CP = 1", config=(("dynamic_context_parallel", 1),)),
        CONFIG,
        ("dynamic_context_parallel=1", "bool"),
    ),
    (
        BadInput("dynamic CP = 'yes'", config=(("dynamic_context_parallel", "yes"),)),
        CONFIG,
        ("dynamic_context_parallel='yes'", "True or False"),
    ),
    (
        BadInput("min dynamic CP size 3", config=(*DYNAMIC, ("min_dynamic_context_parallel_size", 3))),
        CONFIG,
        ("min_dynamic_context_parallel_size=3", "power of two"),
    ),
    (
        BadInput("scheduler misspelt", config=(("sequence_packing_scheduler", "DP_BALANCED"),)),
        CONFIG,  # a typo is the config's mistake, not the pin's
        ("'DP_BALANCED' is not a scheduler name", "did you mean 'dp_balanced'?"),
    ),
    (
        BadInput("capacity differs on one rank", rank_config=(("max_seqlen_per_dp_cp_rank", 64),)),
        CONFIG,
        ("max_seqlen_per_dp_cp_rank differs", "DP rank 1", "(64 there, 32 on global rank 0)", "set it identically"),
    ),
    (
        BadInput("scheduler differs on one rank", rank_config=(("sequence_packing_scheduler", "balanced"),)),
        CONFIG,
        ("sequence_packing_scheduler differs", "identically"),
    ),
    (
        BadInput("sequence_parallel differs on one rank", dp_rank=0, rank_config=(("sequence_parallel", True),)),
        CONFIG,
        ("sequence_parallel differs", "DP rank 1", "set it identically"),
    ),
    (BadInput("scheduler None", config=(("sequence_packing_scheduler", None),)), CONFIG, ("scheduler name",)),
    (
        BadInput("capacity None on one rank", rank_config=(("max_seqlen_per_dp_cp_rank", None),)),
        CONFIG,
        ("max_seqlen_per_dp_cp_rank=None", "positive int", "on global rank", "DP rank 1", "only"),
    ),
    (
        BadInput("capacity zero on one rank", dp_rank=0, rank_config=(("max_seqlen_per_dp_cp_rank", 0),)),
        CONFIG,
        ("max_seqlen_per_dp_cp_rank=0", "DP rank 0", "same way on every rank"),
    ),
    (
        BadInput("dynamic CP = 'yes' on one rank", rank_config=(("dynamic_context_parallel", "yes"),)),
        CONFIG,
        ("dynamic_context_parallel='yes'", "True or False", "DP rank 1"),
    ),
    (
        BadInput("scheduler misspelt on one rank", rank_config=(("sequence_packing_scheduler", "dp-balanced"),)),
        CONFIG,
        ("'dp-balanced' is not a scheduler name", "DP rank 1", "only"),
    ),
    (
        BadInput("scheduler None on one rank", dp_rank=0, rank_config=(("sequence_packing_scheduler", None),)),
        CONFIG,
        ("scheduler name", "DP rank 0"),
    ),
    (
        BadInput(
            "min dynamic CP size 3 on one rank",
            dynamic_cp=True,
            rank_config=(("min_dynamic_context_parallel_size", 3),),
        ),
        CONFIG,
        ("min_dynamic_context_parallel_size=3", "power of two", "DP rank 1"),
    ),
    (
        BadInput(
            "capacity None, dynamic CP, on one rank",
            dynamic_cp=True,
            rank_config=(("max_seqlen_per_dp_cp_rank", None),),
        ),
        CONFIG,
        ("max_seqlen_per_dp_cp_rank=None", "DP rank 1"),
    ),
    (
        BadInput("THD max sequences 0", config=(("thd_max_packed_sequences", 0),)),
        CONFIG,
        ("thd_max_packed_sequences=0",),
    ),
    (
        BadInput("THD max sequences a float", config=(("thd_max_packed_sequences", 8.0),)),
        CONFIG,
        ("thd_max_packed_sequences=8.0",),
    ),
    (
        BadInput("THD max sequences differs on one rank", rank_config=(("thd_max_packed_sequences", 64),)),
        CONFIG,
        ("thd_max_packed_sequences", "DP rank 1"),
    ),
    (
        BadInput("pad alignment negative", config=(("pad_packed_seq_alignment", -8),)),
        CONFIG,
        ("pad_packed_seq_alignment=-8",),
    ),
    (
        BadInput("pad alignment on one rank", dp_rank=0, rank_config=(("pad_packed_seq_alignment", 8),)),
        "ValueError",  # dev: the settings differ (PackingConfigError); portable: refused there (UnsupportedPinError)
        ("pad_packed_seq_alignment", "global rank 0"),
    ),
    (
        BadInput("tail padding policy misspelt", config=(("thd_tail_padding_policy", "extend-last"),)),
        CONFIG,
        ("thd_tail_padding_policy='extend-last'", "'extend_last'"),
    ),
    (
        BadInput("CP partition mode misspelt", config=(("cp_partition_mode", "zig-zag"),)),
        CONFIG,
        ("cp_partition_mode='zig-zag'", "'zigzag'"),
    ),
    (
        BadInput("model config None on one rank", config_as="none"),
        CONFIG,
        ("model_config=None", "TransformerConfig", "DP rank 1", "only"),
    ),
    (
        BadInput("model config a dict", config_as="dict", dp_rank=None),
        CONFIG,
        ("model_config is a mapping (dict)", "attributes", "TransformerConfig"),
    ),
    (
        BadInput("model config a dict on one rank", config_as="dict", dp_rank=0),
        CONFIG,
        ("model_config is a mapping (dict)", "DP rank 0", "only"),
    ),
    (
        BadInput("a config field unreadable on one rank", unreadable="dynamic_context_parallel"),
        CONFIG,
        ("model_config.dynamic_context_parallel cannot be read", "MissingMandatoryValue", "DP rank 1", "only"),
    ),
    (
        BadInput("a config field unreadable on every rank", unreadable="max_seqlen_per_dp_cp_rank", dp_rank=None),
        CONFIG,
        ("model_config.max_seqlen_per_dp_cp_rank cannot be read", "give model_config.max_seqlen_per_dp_cp_rank a"),
    ),
    (
        BadInput("a layout field unreadable on one rank", unreadable="pipeline_model_parallel_layout", dp_rank=0),
        CONFIG,
        ("model_config.pipeline_model_parallel_layout cannot be read", "DP rank 0", "only"),
    ),
    (
        BadInput("model config None at fetch", fetch_config_none=True, dp_rank=None),
        CONFIG,
        ("model_config=None", "TransformerConfig"),
    ),
    (
        BadInput("pg_collection None on one rank", pg_drop=("*",)),
        CONFIG,
        ("pg_collection=None", "use_mpu_process_groups", "on global rank", "only"),
    ),
    (
        BadInput("pg_collection without dp_cp on one rank", dp_rank=0, pg_drop=("dp_cp",)),
        CONFIG,
        ("pg_collection has no dp_cp group", "DP rank 0", "only"),
    ),
    (
        BadInput("loss_mask requires grad", "loss_mask_requires_grad", index=-1),
        BAD,
        ("'loss_mask'", "requires grad", "loss_mask.detach()", "DP rank 1"),
    ),
    (BadInput("position_ids int32", "position_ids_int32"), BAD, ("'position_ids'", "torch.int32", "torch.int64")),
    (BadInput("loss_mask float16", "loss_mask_float16"), BAD, ("'loss_mask'", "torch.float16", "torch.float32")),
    (
        BadInput("tokens a numpy array", "numpy_tokens"),
        BAD,
        ("'tokens' is a numpy.ndarray", "torch.from_numpy(...)"),
    ),
    (BadInput("tuple item", "tuple_item"), BAD, ("item 1", "is a tuple", "list of dicts")),
    (BadInput("padded length 2**40", "huge_padded"), BAD, ("padded_seq_len", "1099511627776")),
    (
        BadInput("every rank runs out partway through the step", "exhausted", dp_rank=None, index=2),
        BAD,
        ("ran out on every data-loading rank partway", "after 2 of num_microbatches=4", "whole number of steps"),
    ),
    (
        BadInput("pre-packed samples with no sequence on one rank", "empty_prepacked_padded", index=-1),
        BAD,
        ("DP rank 1", "'cu_seqlens' marks no sequence", "drop empty samples"),
    ),
    (
        BadInput("pre-packed samples with no sequence on every rank", "empty_prepacked", index=-1, dp_rank=None),
        BAD,
        ("DP rank 0", "'cu_seqlens' marks no sequence"),
    ),
    (BadInput("data_iterator None on a loading rank", "none_iterator"), BAD, ("data_iterator=None", "DP rank 1")),
    (
        BadInput("the last pipeline stage fed other samples", "shortest", pp_rank=-1),
        STAGES,
        ("pipeline stages", "DP rank 1", "same samples"),
    ),
    (
        BadInput("the last pipeline stage fed other tokens of the same lengths", "other_tokens", pp_rank=-1),
        STAGES,
        ("pipeline stages", "DP rank 1", "same samples"),
    ),
    (
        BadInput(
            "one iterator, not a list per virtual stage",
            config=(("virtual_pipeline_model_parallel_size", 2), ("microbatch_group_size_per_vp_stage", 4)),
        ),
        BAD,
        ("not a list", "virtual_pipeline_model_parallel_size=2", "one iterator per virtual pipeline stage"),
    ),
    (
        BadInput("variable_seq_lengths False", config=(("variable_seq_lengths", False),)),
        PIPELINE_CONFIG,
        ("variable_seq_lengths=False", "pipeline stages", "set model_config.variable_seq_lengths=True"),
    ),
    (
        BadInput("variable_seq_lengths unset on one rank", rank_config=(("variable_seq_lengths", None),)),
        PIPELINE_CONFIG,
        ("variable_seq_lengths=None", "DP rank 1", "set model_config.variable_seq_lengths=True"),
    ),
    (
        BadInput("virtual stages a float", config=(("virtual_pipeline_model_parallel_size", 2.0),)),
        CONFIG,
        ("virtual_pipeline_model_parallel_size=2.0", "None", "positive int"),
    ),
    (
        BadInput("virtual stages True", config=(("virtual_pipeline_model_parallel_size", True),)),
        CONFIG,
        ("virtual_pipeline_model_parallel_size=True", "positive int"),
    ),
    (
        BadInput("virtual stages '2' on one rank", rank_config=(("virtual_pipeline_model_parallel_size", "2"),)),
        CONFIG,
        ("virtual_pipeline_model_parallel_size='2'", "DP rank 1"),
    ),
    (
        BadInput(
            "virtual-stage group size 0",
            config=(("virtual_pipeline_model_parallel_size", 1), ("microbatch_group_size_per_vp_stage", 0)),
        ),
        CONFIG,
        ("microbatch_group_size_per_vp_stage=0", "positive int"),
    ),
    (
        BadInput("fewer samples than the VPP microbatch group's bins", num_microbatches=1, dp_rank=None, config=VPP_4),
        BAD,
        ("the global batch has", "use more samples per step"),
    ),
    (
        BadInput("long samples, too few for the VPP group's bins", "at_capacity", index=-1, dp_rank=None, config=VPP_3),
        BAD,
        ("the global batch has", "use more samples per step"),
    ),
    (BadInput("one virtual stage, microbatch group 1", dp_rank=None, config=VPP_1), "ok", ()),
    (
        BadInput("one sequence more than DP can share", "two_at_capacity", index=0, elsewhere="at_capacity"),
        BAD,
        ("use more samples per step",),
    ),
    (
        BadInput("every sequence fits one bin", "shortest", index=-1, dp_rank=None, num_microbatches=1),
        FIRST_BIN,
        ("all fit in one bin", "never splits its first bin", "use more or longer samples per step"),
    ),
    (
        BadInput("only the first bin holds two sequences", "shortest", index=-1, dp_rank=0, elsewhere="at_capacity"),
        FIRST_BIN,
        ("could not round its bin count up to a multiple of", "Not enough samples to move", "use more samples"),
    ),
    (
        BadInput("VPP microbatch group under dynamic CP", dp_rank=None, dynamic_cp=True, config=VPP_4),
        CONFIG,
        ("microbatch_group_size_per_vp_stage=4: with dynamic context parallelism", "None or 1"),
    ),
    (BadInput("num_microbatches -1 on one rank", num_microbatches=-1), CONFIG, ("num_microbatches=-1", "DP rank 1")),
    (BadInput("num_microbatches True on one rank", num_microbatches=True), CONFIG, ("not an int", "DP rank 1")),
    (
        BadInput("sequence_parallel 'False'", config=(("sequence_parallel", "False"),)),
        CONFIG,
        ("sequence_parallel='False'", "True or False"),
    ),
    (BadInput("int64 lengths on one rank", "lengths_int64", index=-1), "ok", ()),
    (BadInput("uint32 padded lengths on one rank", "uint32_padded", index=-1), "ok", ()),
    (BadInput("uint16 original lengths on one rank", "uint16_original", index=-1), "ok", ()),
    (BadInput("int8 lengths on one rank", "int8_lengths", index=-1), "ok", ()),
    (BadInput("uint64 cu_seqlens on one rank", "uint64_cu_seqlens", index=-1), "ok", ()),
    (BadInput("[1, 1] lengths on one rank", "lengths_2d", index=-1), "ok", ()),
    (BadInput("[1, L] fields on one rank", "unsqueezed", index=-1), "ok", ()),
    (BadInput("strided tokens and labels on one rank", "strided_tokens", index=-1), "ok", ()),
    (BadInput("extra int key on one rank", "extra_scalar_key", index=-1), "ok", ()),
    (BadInput("extra string key on one sample", "extra_string_key"), "ok", ()),
    (BadInput("extra tensor key on one rank", "extra_tensor_key", index=-1), "ok", ()),
    (BadInput("no padding on one rank", "all_real", index=-1), "ok", ()),
    (BadInput("no padding on every rank", "all_real", index=-1, dp_rank=None), "ok", ()),
    (BadInput("original_seq_len absent on one rank", "no_original", index=-1), "ok", ()),
    (BadInput("pre-packed without padded bounds on one rank", "prepacked_whole32", index=-1), "ok", ()),
    (BadInput("pre-packed without padded bounds on every rank", "prepacked_whole32", index=-1, dp_rank=None), "ok", ()),
    (BadInput("int64 cu_seqlens on one rank", "prepacked_whole64", index=-1), "ok", ()),
    (BadInput("the same sample object twice on one rank", "aliased"), "ok", ()),
    (BadInput("a copy of a sample twice on one rank", "duplicated"), "ok", ()),
    (BadInput("position_ids views of one shared tensor", "shared_positions", index=-1, dp_rank=None), "ok", ()),
    (BadInput("tokens and labels views of one buffer on one rank", "shared_buffer", index=-1), "ok", ()),
    (BadInput("extra fetch", extra_fetch=True), "ok", ()),
    (
        BadInput("fetch from the consumed sample iterator", fetch_from="raw"),
        BAD,
        ("get_batch_for_global_batch_packing", "pass the", "wrap_data_iterator_for_global_batch_packing"),
    ),
    (
        BadInput("fetch from an iterator that raises on TP rank 0", fetch_from="broken", layouts=("2x1x2",)),
        BAD,
        ("could not read the next packed microbatch on TP rank 0", "data_iterator raised", "wrap_data_iterator"),
    ),
    (
        BadInput("fetch from collated SFT batches on TP rank 0", fetch_from="collated", layouts=("2x1x2",)),
        BAD,
        ("yielded a dict without", "not a packed microbatch", "wrap_data_iterator_for_global_batch_packing"),
    ),
    (
        BadInput(
            "fetch from collated SFT batches on TP rank 0, static THD capacity",
            fetch_from="collated",
            config=STATIC_THD,
            layouts=("2x1x2",),
        ),
        PADDED,
        ("not a packed microbatch", "wrap_data_iterator_for_global_batch_packing"),
    ),
    (
        BadInput("fetch microbatches without tokens on TP rank 0", fetch_from="without_tokens", layouts=("2x1x2",)),
        BAD,
        ("yielded a dict without", "not a packed microbatch", "wrap_data_iterator_for_global_batch_packing"),
    ),
    (
        BadInput("fetch from an exhausted iterator on TP rank 0", fetch_from="spent", layouts=("2x1x2",)),
        "StopIteration",
        ("microbatch count", "wrap"),
    ),
    (
        BadInput("fetch from an iterator of strings on TP rank 0", fetch_from="strings", layouts=("2x1x2",)),
        BAD,
        ("something other than a microbatch dict", "wrap_data_iterator"),
    ),
    (
        BadInput("fetch from None on TP rank 0", fetch_from="none"),
        BAD,
        ("data_iterator=None on TP rank 0", "pass that iterator"),
    ),
    (
        BadInput("fetch from None on TP rank 0, static THD capacity", fetch_from="none", config=STATIC_THD),
        PADDED,
        ("data_iterator=None on TP rank 0", "pass that iterator"),
    ),
    (
        BadInput("fetch from the consumed sample iterator, static THD capacity", fetch_from="raw", config=STATIC_THD),
        PADDED,
        ("get_batch_for_global_batch_packing", "pass the", "wrap_data_iterator_for_global_batch_packing"),
    ),
    (
        BadInput("fetch from None on TP rank 0, padded to the maximum", fetch_from="none", config=STATIC_THD_MAX),
        PADDED,
        ("data_iterator=None on TP rank 0", "pass that iterator"),
    ),
    (
        BadInput("fetch from a list holding the packed iterator", fetch_from="list"),
        BAD,
        ("get_batch_for_global_batch_packing", "not an iterator", "pass the packed iterator"),
    ),
    (
        BadInput(
            "odd length, dynamic CP with sequence parallelism",
            "odd_length",
            dynamic_cp=True,
            config=(("sequence_parallel", True),),
            layouts=("2x1x2",),
        ),
        BAD,
        ("padded_seq_len=", "is not a multiple of", "pad samples to a multiple"),
    ),
    (BadInput("the same sample dicts again on the next step", dp_rank=None, rewrap=True), "ok", ()),
    (BadInput("a rerun in place fetches the step again", dp_rank=None, rerun=True), RERUN, ()),
    (BadInput("good input", dp_rank=None), "ok", ()),
    (BadInput("good input, dynamic CP", dp_rank=None, dynamic_cp=True), "ok", ()),
]


def _layout_id(layout_and_stages: tuple[Layout, int]) -> str:
    layout, stages = layout_and_stages
    return str(layout) if stages == 1 else f"{layout}-pp{stages}"


RANDOM_DEFECTS = [
    BadInput(f"random defect {seed}", f"random:{seed}", dp_rank=seed % 2, index=seed % 4) for seed in range(16)
]
"""Seeded random changes of one or two fields of one sample on one DP rank (both CP siblings): dtypes, shapes, views,
length values, dtypes and types, keys dropped or added, values, subclasses and meta tensors; cases the table does not
spell out, which every rank must answer alike."""
RANDOM_SETTINGS = [random_settings(seed) for seed in range(16)]
"""Seeded random packing settings, good and bad (wrong types, values, spellings), on every rank or on one, with
static or dynamic CP (:func:`~tests.bad_input_ranks.random_settings`)."""


@pytest.fixture(scope="module", params=LAYOUTS, ids=_layout_id)
def outcomes(request: pytest.FixtureRequest) -> dict:
    layout, stages = request.param
    cases = [case for case, _, _ in CASES] + RANDOM_DEFECTS + RANDOM_SETTINGS
    world = layout.world_size * stages
    per_rank = launch(
        bad_inputs_on_rank, world, args=(layout, cases, BASE, stages), sys_path=SYS_PATH, timeout=240, pg_timeout=20
    )
    return {"layout": _layout_id(request.param), "world": world, "pipeline": stages > 1, **_collected(per_rank)}


def _collected(per_rank: list[dict]) -> dict:
    """Every rank's outcomes by case (``runs``), the backend, and what the pin's generation makes of the cases whose
    expectation depends on it."""
    runs: dict[str, list] = {}
    for rank_result in per_rank:
        for outcome in rank_result["outcomes"]:
            runs.setdefault(outcome.name, []).append(outcome)
    generation = GENERATIONS.get(per_rank[0]["generation"] or "")
    return {
        "backend": per_rank[0]["backend"],
        "replays_unedited": per_rank[0]["replays_unedited"],
        "runs": runs,
        "first_bin_refused": _first_bin_refused(per_rank),
        "fixed_entry": generation is not None and generation.virtual_stage_source == "by_pipeline_stage",
    }


def _first_bin_refused(per_rank: list[dict]) -> bool:
    """Whether the step that ran used Megatron-Core's own dp_balanced where it never splits its first bin (main)."""
    generation = GENERATIONS.get(per_rank[0]["generation"] or "")
    native = per_rank[0]["backend"] == "native"
    return native and generation is not None and generation.dp_balanced_first_bin_donates is False


@pytest.mark.parametrize(("case", "expected", "fragments"), CASES, ids=[c.name for c, _, _ in CASES])
def test_every_rank_raises_the_same_clear_error(outcomes: dict, case: BadInput, expected: str, fragments: tuple):
    if case.layouts and outcomes["layout"] not in case.layouts:
        pytest.skip(f"{case.name} needs layout {case.layouts}")
    _assert_alike_and_clear(outcomes, case, expected, fragments)


def _assert_alike_and_clear(outcomes: dict, case: BadInput, expected: str, fragments: tuple) -> None:
    """Every rank ended ``case`` with the same outcome, the ``expected`` kind whose message holds ``fragments``,
    within :data:`SECONDS`."""
    ranks = outcomes["runs"][case.name]
    assert len(ranks) == outcomes["world"]
    if {o.kind for o in ranks} == {"skipped"}:  # a dynamic-CP case the probe refused
        refused("default_dynamic_cp", True, f"{case.name}: {ranks[0].message}")
    tp = int(outcomes.get("layout", "1").split("x")[0])
    if expected == RERUN and outcomes["backend"] == "native" and tp == 1 and not outcomes["replays_unedited"]:
        pytest.skip(
            "this pin's RerunDataIterator replays the microbatch dicts its own fetch edited (TP 1: as given): "
            f"{sorted({o.kind for o in ranks})}"
        )
    seen = {(o.kind, o.message) for o in ranks}
    assert len(seen) == 1, f"ranks disagree on {outcomes['backend']}: {seen}"
    ((kind, message),) = seen
    if case.dynamic_cp and outcomes["pipeline"] and PIPELINE_REFUSES_DYNAMIC_CP in message:
        assert all(o.config_error for o in ranks), (kind, message)  # where dynamic CP runs without PP only
        return
    if expected == FIRST_BIN:
        expected, fragments = (BAD, fragments) if outcomes["first_bin_refused"] else ("ok", ())
    if expected == FIXED_ENTRY:
        expected, fragments = (BAD, fragments) if outcomes["fixed_entry"] else ("ok", ())
    if expected == STAGES:
        expected, fragments = (BAD, fragments) if outcomes["pipeline"] else ("ok", ())
    if expected == PIPELINE_CONFIG:
        expected, fragments = (CONFIG, fragments) if outcomes["pipeline"] else ("ok", ())
    if expected == RERUN:
        expected = "ok"
    if expected == PADDED:
        expected, fragments = (
            ("UnsupportedPinError", ("pad_packed_seq_alignment",))
            if outcomes["backend"] == "portable"
            else (BAD, fragments)
        )
    if expected == BAD:
        assert all(o.bad_sample_error for o in ranks), (kind, message)
    elif expected == CONFIG:
        assert all(o.config_error for o in ranks), (kind, message)
    elif expected == "ValueError":
        assert isinstance(kind, str) and kind.endswith("Error") and kind != "RuntimeError", (kind, message)
    else:
        assert kind == expected, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert max(o.seconds for o in ranks) < SECONDS


RANDOM_CASES = [(case, "bad_sample_error") for case in RANDOM_DEFECTS] + [
    (case, "packing_error") for case in RANDOM_SETTINGS
]
"""Each random case with the flag every rank's error must carry where the step does not pack."""


@pytest.mark.parametrize(("case", "error"), RANDOM_CASES, ids=[c.name for c, _ in RANDOM_CASES])
def test_a_random_case_ends_alike_on_every_rank(outcomes: dict, case: BadInput, error: str):
    """Either every rank packs the step or every rank raises the same error: ``BadSampleError`` for a defect, a
    packing error for settings (a config error, an unsupported pin, or bad samples where the settings make them so);
    never a raw error, a rank left waiting, or a step that runs on some ranks only."""
    ranks = outcomes["runs"][case.name]
    assert len(ranks) == outcomes["world"]
    seen = {(o.kind, o.message) for o in ranks}
    assert len(seen) == 1, f"ranks disagree on {outcomes['backend']}: {seen}"
    ((kind, message),) = seen
    if kind == "ok":
        assert {o.microbatches for o in ranks} != {0}
    elif kind != "skipped":  # a dynamic-CP case on a pin without dynamic CP
        assert all(getattr(o, error) for o in ranks), (kind, message)
    assert max(o.seconds for o in ranks) < SECONDS


@pytest.mark.parametrize("case", [*(f"padding ids {pad}" for pad in PAD_IDS[1:]), "padding ids -100, dynamic CP"])
def test_any_padding_id_fetches_the_microbatches_of_zero_padding(outcomes: dict, case: str):
    """Padding follows the pin: each rank ends as with 0 in every padding slot and fetches the same microbatches (the
    zero-padding case itself must pack: its row of the table)."""
    zero = "padding ids 0, dynamic CP" if "dynamic" in case else "padding ids 0"
    ranks, reference = outcomes["runs"][case], outcomes["runs"][zero]
    assert len(ranks) == len(reference) == outcomes["world"]
    for got, ref in zip(ranks, reference, strict=True):
        assert (got.kind, got.message) == (ref.kind, ref.message), f"rank {got.rank}: {got.message}"
        assert got.fetched == ref.fetched, f"rank {got.rank} fetched other microbatches than with zero padding"
    assert any(o.fetched for o in ranks) or ranks[0].kind != "ok"


def test_a_fetch_after_the_last_microbatch_raises_stop_iteration_on_every_rank(outcomes: dict):
    ranks = outcomes["runs"]["extra fetch"]
    fetches = {o.fetch for o in ranks}
    assert len(fetches) == 1, fetches
    ((kind, message),) = fetches
    assert kind == "StopIteration"
    assert "get_batch was called more often" in message


def test_good_input_after_bad_input_runs(outcomes: dict):
    ranks = outcomes["runs"]["good input"]
    assert {o.microbatches for o in ranks} != {0}


def _assert_reads_only_checked_fields(collected: dict) -> None:
    reads = {name for ranks in collected["runs"].values() for o in ranks if o.kind == "ok" for name in o.config_reads}
    assert "max_seqlen_per_dp_cp_rank" in reads
    assert reads <= set(STEP_FIELDS), sorted(reads - set(STEP_FIELDS))


def test_a_step_reads_only_config_fields_checked_before_the_agreement(outcomes: dict):
    """Every model-config field a step that packs reads (wrap and fetches: the facade and the pin's own scheduler)
    is one ``check_config_object`` reads first, so a field whose reading raises is refused on every rank together
    instead of inside a collective."""
    _assert_reads_only_checked_fields(outcomes)


GOOD = "good input"
SAME_MICROBATCHES = [
    ("pre-packed on one rank, unpacked on the others", GOOD),
    ("int64 lengths on one rank", GOOD),
    ("uint32 padded lengths on one rank", GOOD),
    ("uint16 original lengths on one rank", GOOD),
    ("int8 lengths on one rank", GOOD),
    ("uint64 cu_seqlens on one rank", GOOD),
    ("[1, 1] lengths on one rank", GOOD),
    ("[1, L] fields on one rank", GOOD),
    ("strided tokens and labels on one rank", GOOD),
    ("extra int key on one rank", GOOD),
    ("extra string key on one sample", GOOD),
    ("extra tensor key on one rank", GOOD),
    ("pre-packed without padded bounds on one rank", "no padding on one rank"),
    ("int64 cu_seqlens on one rank", "no padding on one rank"),
    ("pre-packed without padded bounds on every rank", "no padding on every rank"),
    ("the same sample object twice on one rank", "a copy of a sample twice on one rank"),
    ("original_seq_len absent on one rank", "no padding on one rank"),
    ("position_ids views of one shared tensor", GOOD),
    ("tokens and labels views of one buffer on one rank", GOOD),
]


@pytest.mark.parametrize(("name", "reference"), SAME_MICROBATCHES)
def test_every_accepted_sample_layout_packs_the_same(outcomes: dict, name: str, reference: str):
    """Samples in either form, with lengths of any integer dtype or ``[1, 1]``, ``[1, L]`` or strided fields, extra
    keys, or fields that share storage (one sample object pulled twice, views of one buffer), on one DP rank give every
    rank the very microbatches the same sequences give as plain unpacked samples (nothing writes into them)."""
    expected = {o.rank: o.fetched for o in outcomes["runs"][reference]}
    other = {o.rank: o.fetched for o in outcomes["runs"][name]}
    assert all(expected.values())
    assert other == expected


PIPELINE_STAGES = 3
"""Enough pipeline stages for a middle one, which loads no data where the first and last stages load it."""
ROUNDING_CASES = ("only the first bin holds two sequences", "one sequence more than DP can share")


def test_every_pipeline_stage_raises_a_step_the_scheduler_cannot_round():
    """With three pipeline stages and TP 2 (the middle stage's TP rank 0 gets the schedule from the first stage by
    broadcast where only the first and last load data, then hands it to its TP rank 1), a step Megatron-Core's
    dp_balanced cannot round fails on every rank of every stage with the same error, and the next good step runs
    (the table runs every case at TP 1 with three stages)."""
    layout = Layout(2, 1, 2)
    table = {case.name: (case, expected) for case, expected, _ in CASES}
    played = [table[name] for name in ROUNDING_CASES] + [table["good input"]]
    world = PIPELINE_STAGES * layout.world_size
    per_rank = launch(
        bad_inputs_on_rank,
        world,
        args=(layout, [case for case, _ in played], BASE, PIPELINE_STAGES),
        sys_path=SYS_PATH,
        timeout=240,
        pg_timeout=20,
    )
    for case, expected in played:
        ranks = [o for result in per_rank for o in result["outcomes"] if o.name == case.name]
        assert len(ranks) == world
        seen = {(o.kind, o.message) for o in ranks}
        assert len(seen) == 1, f"ranks disagree on {case.name}: {seen}"
        if expected == FIRST_BIN:
            expected = BAD if _first_bin_refused(per_rank) else "ok"
        if expected == BAD:
            assert all(o.bad_sample_error for o in ranks), seen
            assert "use more samples" in ranks[0].message
        else:
            assert {o.kind for o in ranks} == {"ok"}, seen
            assert {o.microbatches for o in ranks} != {0}
        assert max(o.seconds for o in ranks) < SECONDS


INTERLEAVED = ((Layout(1, 1, 2), 2, 2), (Layout(2, 1, 2), 2, 2))
"""Layouts with pipeline stages and interleaved virtual stages each (``(layout, pp, vpp)``): every rank passes one
iterator per virtual stage and fetches each stage's microbatches in turn; the second has TP ranks that load none."""
INTERLEAVED_TABLE_CASES = (
    "missing key",
    "tokens/labels mismatch",
    "NaN length",
    "non-dict item",
    "zero position_ids",
    "oversize on one rank",
    "one rank exhausted",
    "iterator raises",
    "the last pipeline stage fed other samples",
    "num_microbatches differs",
    "capacity differs on one rank",
    "extra fetch",
    "fetch from the consumed sample iterator",
    "fetch from None on TP rank 0",
    "fetch from None on TP rank 0, static THD capacity",
    "fetch from the consumed sample iterator, static THD capacity",
    "fetch from None on TP rank 0, padded to the maximum",
    GOOD,
)
"""Cases of :data:`CASES` played with interleaved virtual stages, with the table's expectations."""
UNCHECKED = "good input, the pin's own wrap and fetch"
FIXED_ENTRY = "refused where the scheduler pulls from a fixed entry per pipeline stage"
"""An iterator list with None where Megatron-Core pulls by pipeline stage (main: ``[0]`` on the first stage, ``[-1]``
on the last): BAD there with the case's fragments; where it pulls from the first entry that is not None (dev, the
portable backend on a release), the step packs as good input does."""
INTERLEAVED_CASES: list[tuple[BadInput, str, tuple[str, ...]]] = [
    *[(case, expected, fragments) for case, expected, fragments in CASES if case.name in INTERLEAVED_TABLE_CASES],
    (
        BadInput("one virtual stage's iterator missing on one rank", "stages_short"),
        BAD,
        ("DP rank 1", "a list of 1", "virtual_pipeline_model_parallel_size=2", "one iterator per virtual"),
    ),
    (
        BadInput("one iterator, not the list of virtual stages, on one rank", "stages_not_a_list"),
        BAD,
        ("DP rank 1", "not a list", "one iterator per virtual pipeline stage"),
    ),
    (
        BadInput("None for every virtual stage on a loading rank", "stages_none"),
        BAD,
        ("None on DP rank 1", "sample iterator"),
    ),
    (
        BadInput("fetch from the list of every stage's iterators", fetch_from="list"),
        BAD,
        ("get_batch_for_global_batch_packing", "list", "vp_stage"),
    ),
    (
        BadInput("an iterator in the first virtual stage's entry only", "stages_first_only", dp_rank=None),
        FIXED_ENTRY,
        ("data_iterator[-1] is None", "last pipeline stage", "virtual_pipeline_model_parallel_size=2"),
    ),
    (
        BadInput("an iterator in the last virtual stage's entry only", "stages_last_only", dp_rank=None),
        FIXED_ENTRY,
        ("data_iterator[0] is None", "first pipeline stage", "virtual_pipeline_model_parallel_size=2"),
    ),
    (BadInput(UNCHECKED, dp_rank=None, unchecked=True), "ok", ()),
]


@pytest.fixture(scope="module", params=INTERLEAVED, ids=lambda p: f"{p[0]}-pp{p[1]}-vpp{p[2]}")
def interleaved(request: pytest.FixtureRequest) -> dict:
    layout, stages, virtual = request.param
    cases = [case for case, _, _ in INTERLEAVED_CASES] + RANDOM_DEFECTS
    world = layout.world_size * stages
    per_rank = launch(
        bad_inputs_on_rank,
        world,
        args=(layout, cases, BASE, stages, virtual),
        sys_path=SYS_PATH,
        timeout=240,
        pg_timeout=20,
    )
    return {"world": world, "pipeline": True, "virtual": virtual, **_collected(per_rank)}


@pytest.mark.parametrize(
    ("case", "expected", "fragments"), INTERLEAVED_CASES, ids=[c.name for c, _, _ in INTERLEAVED_CASES]
)
def test_interleaved_stages_fail_alike_on_every_rank(interleaved: dict, case: BadInput, expected: str, fragments):
    """With interleaved virtual pipeline stages (a list of iterators per rank, each stage fetched in turn), bad
    input and a bad iterator list fail on every rank of every stage with the same clear error."""
    _assert_alike_and_clear(interleaved, case, expected, fragments)


@pytest.mark.parametrize(("case", "error"), [(c, "bad_sample_error") for c in RANDOM_DEFECTS], ids=lambda c: c)
def test_interleaved_random_defects_end_alike(interleaved: dict, case: BadInput, error: str):
    ranks = interleaved["runs"][case.name]
    assert len(ranks) == interleaved["world"]
    seen = {(o.kind, o.message) for o in ranks}
    assert len(seen) == 1, f"ranks disagree on {interleaved['backend']}: {seen}"
    assert seen == {("ok", "")} or all(o.bad_sample_error for o in ranks), seen


def test_interleaved_steps_read_only_config_fields_checked_before_the_agreement(interleaved: dict):
    _assert_reads_only_checked_fields(interleaved)


def test_interleaved_good_input_packs_as_the_pin_does(interleaved: dict):
    """Through the facade, every rank fetches on every virtual stage the very microbatches the pin's own ``wrap``
    and fetch give it without the checks."""
    checked = {o.rank: (o.microbatches, o.fetched) for o in interleaved["runs"][GOOD]}
    unchecked = {o.rank: (o.microbatches, o.fetched) for o in interleaved["runs"][UNCHECKED]}
    assert {count for count, _ in checked.values()} != {0}
    assert all(len(fetched) == count * interleaved["virtual"] for count, fetched in checked.values())
    assert checked == unchecked


@pytest.mark.parametrize("name", [c.name for c, expected, _ in INTERLEAVED_CASES if expected == FIXED_ENTRY])
def test_interleaved_iterator_in_one_entry_packs_as_good_input_where_accepted(interleaved: dict, name: str):
    """Where the pin pulls from the first entry that is not None, one iterator in any entry packs the same
    microbatches as an iterator in every entry."""
    if interleaved["fixed_entry"]:
        pytest.skip("this pin pulls by pipeline stage: the case is refused (checked with the table)")
    expected = {o.rank: o.fetched for o in interleaved["runs"][GOOD]}
    assert {o.rank: o.fetched for o in interleaved["runs"][name]} == expected


def test_interleaved_fetch_past_the_count_stops_on_every_stage(interleaved: dict):
    """One fetch more than the count on each virtual stage raises ``StopIteration`` on every rank, on each stage."""
    ranks = interleaved["runs"]["extra fetch"]
    assert all(len(o.stage_fetches) == interleaved["virtual"] for o in ranks)
    seen = {fetch for o in ranks for fetch in o.stage_fetches}
    assert len(seen) == 1, seen
    ((kind, message),) = seen
    assert kind == "StopIteration"
    assert "get_batch was called more often" in message
