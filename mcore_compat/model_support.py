"""Make Megatron-Core's attention follow each microbatch's dynamic CP group on pins whose model code does not.

Dynamic CP puts each packed bin on a DP x CP sub-group sized for it and hands that group to the model
in ``packed_seq_params.cp_group`` / ``local_cp_size``. On megatron-core 0.16.1-0.19.2 and ``main``
up to the pinned tip, ``Attention.forward`` still gives RoPE the static CP group, and Transformer
Engine's CP stream exists only when the static ``context_parallel_size`` is above 1 (Megatron-LM
PR #6821 fixes both on ``main``; dev switches the group in ``Attention.forward``).
:func:`enable_dynamic_cp_model_support` installs that switch on such pins; MLA, MTP, MoE aux-loss
reduction and Mamba are not covered and are refused by :func:`dynamic_cp_model_refusal`.

Which components follow the microbatch's group is read from the pin's own source (never from its
version): a component follows when its code reads ``packed_seq_params.cp_group`` or calls
``resolve_cp_group`` (the TE CP stream: when ``TEDotProductAttention.forward`` creates a stream).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from mcore_compat.errors import BadSampleError
from mcore_compat.generations import MODEL_COMPONENTS, ModelComponent

__all__ = [
    "MODEL_COMPONENTS",
    "NoContextParallelGroup",
    "dynamic_cp_component_refusal",
    "dynamic_cp_model_refusal",
    "enable_dynamic_cp_model_support",
    "model_components_following_in_source",
    "model_components_following_microbatch_cp_group",
    "model_support_applied",
]

log = logging.getLogger(__name__)

ATTENTION_MODULE = "megatron.core.transformer.attention"
_WRAPPED_MARK = "__mcore_compat_follows_microbatch_cp_group__"
_READS_GROUP = "reads packed_seq_params.cp_group"
_CREATES_STREAM = "creates a CUDA stream"

# component -> (module, class or None for the whole module, method, what marks "follows")
_COMPONENT_SOURCES: dict[ModelComponent, tuple[str, str | None, str | None, str]] = {
    "attention": (ATTENTION_MODULE, "Attention", "forward", _READS_GROUP),
    "te_cp_stream": (
        "megatron.core.extensions.transformer_engine",
        "TEDotProductAttention",
        "forward",
        _CREATES_STREAM,
    ),
    "mla": ("megatron.core.transformer.multi_latent_attention", "MultiLatentAttention", "forward", _READS_GROUP),
    "mtp": ("megatron.core.transformer.multi_token_prediction", None, None, _READS_GROUP),
    "moe_aux_loss": ("megatron.core.transformer.moe.router", None, None, _READS_GROUP),
    "mamba": ("megatron.core.ssm.mamba_mixer", None, None, _READS_GROUP),
}

UPSTREAM_ATTENTION_FIX = "Megatron-LM PR #6821 (merged into main after the pinned main commit)"


def _remedy() -> str:
    """A static-CP scheduler, or the pins whose model code follows the microbatch's group (``pins.toml``)."""
    from mcore_compat.generations import GENERATIONS, MODEL_COMPONENTS
    from mcore_compat.pins import load

    names = [
        pin.name
        for pin in load().pins.values()
        if set(MODEL_COMPONENTS) <= set(GENERATIONS[pin.generation].model_follows_microbatch_cp_group)
    ]
    switch = " or ".join(f"`mcore-compat pin {name}`" for name in names) or "a Megatron-Core dev pin"
    return (
        f"use a static-CP scheduler (dp_balanced) for this model, or switch with {switch}, "
        "whose model code follows the microbatch's group"
    )


class NoContextParallelGroup:
    """Stands in for a size-1 CP group: a bin that runs without CP on this rank alone.

    Releases and ``main`` create DP x CP sub-groups only from size 2 up, so such a bin carries
    ``local_cp_size=1`` and no group. RoPE reads only ``size()`` and ``rank()`` of the group it is
    given; Transformer Engine is left to turn CP off itself (``cp_group`` stays None in
    ``packed_seq_params``). Not a ``ProcessGroup``: no collective can run on it.
    """

    def size(self) -> int:
        """One rank."""
        return 1

    def rank(self) -> int:
        """This rank is rank 0 of its own group."""
        return 0

    def __repr__(self) -> str:
        return "NoContextParallelGroup()"


NO_CP_GROUP = NoContextParallelGroup()


def _module_source(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def _scope(tree: ast.Module, cls: str | None, method: str | None) -> ast.AST | None:
    if cls is None:
        return tree
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                    return item
    return None


def _marks(scope: ast.AST, marker: str) -> bool:
    for node in ast.walk(scope):
        if marker == _CREATES_STREAM:
            if isinstance(node, ast.Attribute) and node.attr == "Stream":
                return True
        elif isinstance(node, ast.Attribute) and node.attr == "cp_group":
            if isinstance(node.value, ast.Name) and node.value.id == "packed_seq_params":
                return True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "resolve_cp_group":
            return True
    return False


def model_components_following_in_source(read_source: Callable[[str], str | None]) -> tuple[ModelComponent, ...]:
    """The model components whose code runs on ``packed_seq_params.cp_group``, given a module-source reader.

    ``read_source(module)`` returns the text of a ``megatron.core`` module or None when it is absent;
    an absent or unparsable component counts as not following.
    """
    following: list[ModelComponent] = []
    for component, (module, cls, method, marker) in _COMPONENT_SOURCES.items():
        source = read_source(module)
        if source is None:
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        scope = _scope(tree, cls, method)
        if scope is not None and _marks(scope, marker):
            following.append(component)
    return tuple(following)


@functools.lru_cache(maxsize=1)
def model_components_following_microbatch_cp_group() -> tuple[ModelComponent, ...]:
    """The installed pin's model components that follow the microbatch's CP group, read from its source.

    Independent of :func:`enable_dynamic_cp_model_support` (what the pin itself does).
    """
    return model_components_following_in_source(_module_source)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.called = False
        self.changes: tuple[str, ...] = ()


_STATE = _State()


def _new_cp_stream() -> Any:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def _microbatch_group(packed_seq_params: Any, local_cp_size: Any) -> Any:
    group = getattr(packed_seq_params, "cp_group", None)
    if group is not None:
        return group
    if int(local_cp_size) == 1:
        return NO_CP_GROUP
    raise BadSampleError(
        f"packed_seq_params.local_cp_size={local_cp_size} without packed_seq_params.cp_group: a dynamic-CP "
        "microbatch on more than one rank must carry its DP x CP sub-group (the pin's "
        "get_hybrid_data_context_parallel_groups(group_size=local_cp_size))"
    )


def _class_holding(core_attention: Any, name: str) -> type | None:
    for klass in type(core_attention).__mro__:
        if name in vars(klass):
            return klass
    return None


def _ensure_cp_stream(core_attention: Any) -> None:
    """Create the TE CP stream the release wrapper only creates for a static CP size above 1."""
    holder = _class_holding(core_attention, "cp_stream")
    if holder is not None and vars(holder)["cp_stream"] is None:
        holder.cp_stream = _new_cp_stream()  # type: ignore[attr-defined]


def _te_static_group(attention: Any, core_attention: Any) -> tuple[Any, Any] | None:
    """TE's constructor-time CP group and ranks, when the model was built with static CP above 1."""
    if getattr(attention.config, "context_parallel_size", 1) <= 1:
        return None
    names = ("set_context_parallel_group", "cp_group", "cp_global_ranks", "cp_comm_type")
    if not all(hasattr(core_attention, name) for name in names):
        return None
    return core_attention.cp_group, core_attention.cp_global_ranks


def _restore_te_group(core_attention: Any, saved: tuple[Any, Any]) -> None:
    holder = _class_holding(core_attention, "cp_stream")
    stream = vars(holder)["cp_stream"] if holder is not None else None
    core_attention.set_context_parallel_group(saved[0], saved[1], stream, core_attention.cp_comm_type)


def _packed_seq_params_index(forward: Callable[..., Any]) -> int | None:
    names = list(inspect.signature(forward).parameters)
    return names.index("packed_seq_params") - 1 if "packed_seq_params" in names else None


def _follow_microbatch_group(forward: Callable[..., Any], *, create_stream: bool) -> Callable[..., Any]:
    index = _packed_seq_params_index(forward)

    @functools.wraps(forward)
    def forward_on_microbatch_group(self: Any, *args: Any, **kwargs: Any) -> Any:
        packed_seq_params = kwargs.get("packed_seq_params")
        if packed_seq_params is None and index is not None and len(args) > index:
            packed_seq_params = args[index]
        local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
        if local_cp_size is None:
            return forward(self, *args, **kwargs)
        group = _microbatch_group(packed_seq_params, local_cp_size)
        core_attention = getattr(self, "core_attention", None)
        te_static = _te_static_group(self, core_attention) if core_attention is not None else None
        if create_stream and core_attention is not None and group is not NO_CP_GROUP:
            _ensure_cp_stream(core_attention)
        pg_collection = self.pg_collection
        static_group = pg_collection.cp
        pg_collection.cp = group
        try:
            return forward(self, *args, **kwargs)
        finally:
            pg_collection.cp = static_group
            if te_static is not None:
                _restore_te_group(core_attention, te_static)

    setattr(forward_on_microbatch_group, _WRAPPED_MARK, True)
    return forward_on_microbatch_group


def _packed_seq_params_has_dynamic_cp() -> bool:
    try:
        packed = importlib.import_module("megatron.core.packed_seq_params")
    except ImportError:
        return False
    fields = getattr(packed.PackedSeqParams, "__dataclass_fields__", {})
    return "local_cp_size" in fields and "cp_group" in fields


def enable_dynamic_cp_model_support() -> tuple[str, ...]:
    """Make attention run each dynamic-CP microbatch on its own CP group; call once before building the model.

    On pins whose ``Attention.forward`` ignores ``packed_seq_params.cp_group`` (megatron-core
    0.16.1-0.19.2, ``main`` up to the pinned tip), wraps it so that while
    ``packed_seq_params.local_cp_size`` is set the whole forward, RoPE included, runs on
    ``packed_seq_params.cp_group`` (or without CP when ``local_cp_size == 1`` and no group is given),
    Transformer Engine's CP stream is created when a group arrives and none exists, and the static
    group (attention's and TE's) is restored afterwards. Does nothing where the pin already does
    this (dev) or has no dynamic CP. Idempotent and thread-safe; returns (and logs once) what it
    changed. MLA, MTP, MoE and Mamba are not covered: see :func:`dynamic_cp_model_refusal`.
    """
    with _STATE.lock:
        if _STATE.called:
            return _STATE.changes
        following = model_components_following_microbatch_cp_group()
        changes: tuple[str, ...] = ()
        if "attention" in following:
            log.info("Dynamic-CP model support: this Megatron-Core's attention already follows the microbatch's group")
        elif not _packed_seq_params_has_dynamic_cp():
            log.info("Dynamic-CP model support: this Megatron-Core has no dynamic CP (PackedSeqParams.local_cp_size)")
        else:
            attention = importlib.import_module(ATTENTION_MODULE).Attention
            create_stream = "te_cp_stream" not in following
            if not getattr(attention.forward, _WRAPPED_MARK, False):  # e.g. a second copy of this module
                attention.forward = _follow_microbatch_group(attention.forward, create_stream=create_stream)
            changes = (
                "Attention.forward (RoPE included) runs on packed_seq_params.cp_group while local_cp_size is set, "
                "without CP for local_cp_size=1 without a group, and restores the static CP group after",
            )
            if create_stream:
                changes += (
                    "TEDotProductAttention.cp_stream is created when a dynamic CP group arrives and none exists",
                )
            for change in changes:
                log.info("Dynamic-CP model support: %s", change)
        _STATE.called = True
        _STATE.changes = changes
        return changes


def model_support_applied() -> bool:
    """Whether :func:`enable_dynamic_cp_model_support` has been called in this process."""
    return _STATE.called


def _config_components(model_config: Any) -> list[tuple[ModelComponent, str]]:
    used: list[tuple[ModelComponent, str]] = []
    if model_config is None:
        return used
    if getattr(model_config, "multi_latent_attention", False):
        used.append(("mla", "multi-latent attention (multi_latent_attention=True)"))
    mtp = getattr(model_config, "mtp_num_layers", None)
    if mtp:
        used.append(("mtp", f"multi-token prediction (mtp_num_layers={mtp})"))
    experts = getattr(model_config, "num_moe_experts", None)
    if experts:
        used.append(("moe_aux_loss", f"MoE aux-loss reduction (num_moe_experts={experts})"))
    if getattr(model_config, "is_hybrid_model", False):
        used.append(("mamba", "Mamba layers (is_hybrid_model=True)"))
    variant = getattr(model_config, "experimental_attention_variant", None)
    if variant:
        used.append(("attention", f"experimental_attention_variant={variant!r}"))
    return used


_UPSTREAM = {
    "mla": "fixed on dev only (Megatron-LM #4226), no PR for main yet",
    "mtp": "open Megatron-LM PR #7145 for main",
    "moe_aux_loss": "open Megatron-LM PR #7146 for main",
    "mamba": "open Megatron-LM PR #7143 for main",
}


def dynamic_cp_model_refusal(capabilities: Any, model_config: Any = None) -> str | None:
    """Why this pin's model code cannot train correctly under dynamic CP, as one sentence, or None.

    ``capabilities`` is :func:`mcore_compat.detect`'s answer. Pins without dynamic-CP groups are left
    to the probe (None here). Refuses while attention does not follow the microbatch's group and
    :func:`enable_dynamic_cp_model_support` has not been called, and for a ``model_config`` using
    MLA, MTP, MoE or Mamba where the pin's code keeps those on the static CP group.
    """
    if getattr(capabilities, "dynamic_cp_group_getter", None) is None:
        return None
    reason = dynamic_cp_component_refusal(capabilities, model_config)
    if reason is None and not _attention_follows(capabilities) and not model_support_applied():
        return (
            f"dynamic CP on {capabilities.describe()} needs packing.enable_dynamic_cp_model_support() called "
            "before the model is built: this pin's attention rotates RoPE on the static CP group and creates "
            f"Transformer Engine's CP stream only for static CP > 1 (upstream fix: {UPSTREAM_ATTENTION_FIX})"
        )
    return reason


def _following(capabilities: Any) -> set[ModelComponent]:
    following = set(model_components_following_microbatch_cp_group())
    if not following and getattr(capabilities, "generation_info", None) is not None:
        following = set(capabilities.generation_info.model_follows_microbatch_cp_group)
    return following


def _attention_follows(capabilities: Any) -> bool:
    return "attention" in _following(capabilities)


def dynamic_cp_component_refusal(capabilities: Any, model_config: Any) -> str | None:
    """Why a part of the model ``model_config`` describes (MLA, MTP, MoE, Mamba, an attention variant) would
    run a dynamic-CP bin on the static CP group with this pin's code, or None (also for pins without dynamic CP).
    """
    if getattr(capabilities, "dynamic_cp_group_getter", None) is None:
        return None
    following = _following(capabilities)
    attention_follows = "attention" in following
    for component, what in _config_components(model_config):
        if component == "attention":
            if not attention_follows:
                return (
                    f"dynamic CP is not supported for {what} on {capabilities.describe()}: "
                    "enable_dynamic_cp_model_support() covers only Attention.forward; "
                    f"unset the variant or {_remedy()}"
                )
            continue
        if component not in following:
            return (
                f"dynamic CP is not supported for {what} on {capabilities.describe()}: its code keeps the static "
                f"CP group ({_UPSTREAM[component]}); {_remedy()}"
            )
    return None
