"""The modeled compute of a packed step: a sample of length L costs ``a·L + b·L²`` (dense layers; causal attention).

Forward plus backward is three forwards. Per layer and token the dense work is the query, key/value and output
projections and the MLP; causal attention over a document of length L adds ``2·L²·heads·kv_channels`` FLOPs per layer
forward (half of the two ``L x L`` matmuls). The logits add ``2·hidden·vocab`` per token where the vocabulary is known
(the model config does not carry it). Only ratios are reported, so FLOPs stand for time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MODEL", "MODELS", "MODEL_HELP", "CostModel", "CostModelError", "ModelSizes", "parse_model"]

FORWARD_AND_BACKWARD = 3


class CostModelError(ValueError):
    """A model the cost model cannot read: names the field, the value and the fix."""


@dataclass(frozen=True)
class ModelSizes:
    """The sizes that decide a transformer's compute per token and per token pair."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    gated_linear_unit: bool = False
    vocab_size: int = 0

    @classmethod
    def from_config(cls, config: Any) -> ModelSizes:
        """From a Megatron-Core ``TransformerConfig`` (its defaults where a field is None)."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        return cls(
            hidden_size=hidden,
            ffn_hidden_size=int(getattr(config, "ffn_hidden_size", None) or 4 * hidden),
            num_layers=int(config.num_layers),
            num_attention_heads=heads,
            num_query_groups=int(getattr(config, "num_query_groups", None) or heads),
            kv_channels=int(getattr(config, "kv_channels", None) or hidden // heads),
            gated_linear_unit=bool(getattr(config, "gated_linear_unit", False)),
        )


@dataclass(frozen=True)
class CostModel:
    """``cost(L) = linear·L + quadratic·L²`` FLOPs for one sample, forward and backward."""

    linear: float
    quadratic: float

    @classmethod
    def of(cls, sizes: ModelSizes) -> CostModel:
        h, q = sizes.hidden_size, sizes.num_attention_heads * sizes.kv_channels
        kv = 2 * sizes.num_query_groups * sizes.kv_channels
        mlp = 2 * h * sizes.ffn_hidden_size * (3 if sizes.gated_linear_unit else 2)
        per_token = sizes.num_layers * (2 * h * (q + kv) + 2 * q * h + mlp) + 2 * h * sizes.vocab_size
        return cls(FORWARD_AND_BACKWARD * per_token, FORWARD_AND_BACKWARD * sizes.num_layers * 2 * q)

    @classmethod
    def from_config(cls, model_config: Any) -> CostModel | None:
        """From a model config's sizes (:meth:`ModelSizes.from_config`), or None where they do not read as sizes."""
        try:
            sizes = ModelSizes.from_config(model_config)
        except Exception:  # noqa: BLE001 - a stand-in config without sizes, or fields that raise: plan by tokens
            return None
        positive = all(v > 0 for v in (sizes.hidden_size, sizes.num_layers, sizes.num_attention_heads))
        return cls.of(sizes) if positive else None

    @classmethod
    def tokens(cls) -> CostModel:
        """Token count alone (``b = 0``): what a token-balancing scheduler balances."""
        return cls(1.0, 0.0)

    def cost(self, length: int) -> float:
        return self.linear * length + self.quadratic * length * length

    def describe(self) -> str:
        """``a·L + b·L²`` with its figures, and the length at which attention's share equals the dense layers'."""
        even = (
            f"; attention equals the dense layers at L = {self.linear / self.quadratic:,.0f}" if self.quadratic else ""
        )
        return f"{self.linear:.4g}·L + {self.quadratic:.4g}·L² FLOPs per sample (forward and backward){even}"


MODELS: dict[str, ModelSizes] = {
    "llama3-8b": ModelSizes(4096, 14336, 32, 32, 8, 128, True, 128256),
    "llama3-70b": ModelSizes(8192, 28672, 80, 64, 8, 128, True, 128256),
    "qwen2.5-7b": ModelSizes(3584, 18944, 28, 28, 4, 128, True, 152064),
    "qwen2.5-72b": ModelSizes(8192, 29568, 80, 64, 8, 128, True, 152064),
    "mistral-7b": ModelSizes(4096, 14336, 32, 32, 8, 128, True, 32000),
}
"""Published sizes of common models, by name (``plan --model NAME``)."""
DEFAULT_MODEL = "llama3-8b"

_KEYS = {
    "hidden": "hidden_size",
    "ffn": "ffn_hidden_size",
    "layers": "num_layers",
    "heads": "num_attention_heads",
    "groups": "num_query_groups",
    "kv": "kv_channels",
    "vocab": "vocab_size",
}
MODEL_HELP = (
    f"a name ({', '.join(MODELS)}) or sizes such as hidden=4096,ffn=14336,layers=32,heads=32,groups=8,kv=128,glu"
    ",vocab=128256 (groups, kv, ffn and vocab default to heads, hidden/heads, 4*hidden and 0)"
)


def parse_model(text: str) -> ModelSizes:
    """A named model of :data:`MODELS`, or ``key=value`` sizes (``glu`` for a gated MLP)."""
    if text in MODELS:
        return MODELS[text]
    given: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "glu" and not value:
            given["gated_linear_unit"] = True
            continue
        if key not in _KEYS or not value.isdigit() or int(value) < (0 if key == "vocab" else 1):
            raise CostModelError(f"--model {text!r}: {part!r} is not a size; use {MODEL_HELP}")
        given[_KEYS[key]] = int(value)
    missing = [k for k in ("hidden", "layers", "heads") if _KEYS[k] not in given]
    if missing:
        raise CostModelError(f"--model {text!r}: give {', '.join(missing)}; use {MODEL_HELP}")
    heads, hidden = given["num_attention_heads"], given["hidden_size"]
    given.setdefault("ffn_hidden_size", 4 * hidden)
    given.setdefault("num_query_groups", heads)
    given.setdefault("kv_channels", hidden // heads or 1)
    return ModelSizes(**given)
