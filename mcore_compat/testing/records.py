"""What the harness runs (layouts, cases) and what each rank records (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mcore_compat.testing.samples import SampleSpec, alignment_multiple

Fault = Literal["wrong_split", "drop_last"]


@dataclass(frozen=True)
class Layout:
    """A tp·cp·dp layout with PP = 1 (TP innermost, as ``initialize_model_parallel`` orders ranks)."""

    tp: int
    cp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp

    def __str__(self) -> str:
        return f"{self.tp}x{self.cp}x{self.dp}"


@dataclass(frozen=True)
class Case:
    """One layout and scheduler driven for ``steps`` steps; ``fault`` injects a defect for negative controls.

    ``wrong_split`` replaces the zigzag CP partition with a contiguous one; ``drop_last`` skips the
    last packed microbatch of every step.
    """

    layout: Layout
    scheduler: str = "dp_balanced"
    dynamic_cp: bool = False
    min_dynamic_cp_size: int = 1
    steps: int = 3
    num_microbatches: int = 8
    samples_per_next: int = 1
    max_seqlen_per_dp_cp_rank: int = 64
    seed: int = 0
    long_fraction: float = 0.25
    fault: Fault | None = None
    item_layouts: tuple[str, ...] = ("plain",)
    """Per DP rank (cycled), how its items carry the samples (:data:`~mcore_compat.testing.samples.ITEM_LAYOUTS`)."""

    @property
    def name(self) -> str:
        parts = [self.scheduler, str(self.layout)]
        if self.dynamic_cp and self.min_dynamic_cp_size > 1:
            parts.append(f"min{self.min_dynamic_cp_size}")
        if self.samples_per_next > 1:
            parts.append(f"x{self.samples_per_next}")
        if self.fault:
            parts.append(self.fault)
        if self.item_layouts != ("plain",):
            parts.append("+".join(self.item_layouts))
        return "-".join(parts)

    @property
    def sample_spec(self) -> SampleSpec:
        """Samples aligned for this layout that fit its bins (× cp static, × dp·cp dynamic)."""
        tp, cp, dp = self.layout.tp, self.layout.cp, self.layout.dp
        pool = dp * cp if self.dynamic_cp else cp
        return SampleSpec(
            seed=self.seed,
            dp=dp,
            num_microbatches=self.num_microbatches,
            samples_per_next=self.samples_per_next,
            multiple=alignment_multiple(tp=tp, cp=cp, dp=dp, dynamic_cp=self.dynamic_cp),
            capacity=self.max_seqlen_per_dp_cp_rank * pool,
            long_fraction=self.long_fraction,
            layouts=self.item_layouts,
        )


@dataclass
class MicrobatchRecord:
    """One packed microbatch as get-batch and finalize left it on one rank (tensors cloned to CPU)."""

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    padding_mask: torch.Tensor | None
    attention_mask_is_none: bool
    qkv_format: str | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_kv: torch.Tensor | None
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    max_seqlen_q: int | None
    max_seqlen_kv: int | None
    local_cp_size: int | None
    cp_group_ranks: tuple[int, ...]
    cp_group_rank: int
    route_set: bool | None
    """Whether ``cp_partition_route`` is set after finalize; None where the pin has no CP-layout routes."""


@dataclass
class RankStep:
    """Everything one rank saw in one step."""

    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    num_microbatches: int
    seqlen_sum: float
    seqlen_squared_sum: float
    iterator_is_none: bool
    exhausted: bool | None
    """On ranks with a packed iterator: whether ``next()`` raised StopIteration after the consumed microbatches."""
    source_pulls: int
    microbatches: list[MicrobatchRecord] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time of the wrap and every fetch and finalize of the step on this rank."""


@dataclass
class CaseResult:
    """One rank's outcome for one case: the probe's reason when the pin cannot run it, else its steps."""

    case: Case
    rank: int
    skipped: str | None
    patches: tuple[str, ...] = ()
    steps: list[RankStep] = field(default_factory=list)
    generation: str | None = None
    backend: str | None = None
    """The backend that packed the steps: ``native`` where Megatron-Core's own ``wrap_data_iterator`` ran, else
    ``portable``; for a skipped case, the adapter's."""
    routes: bool = False
    """Whether the pin prebuilds THD CP partition routes in finalize (dev G7+)."""
    padding_mask: bool = True
    """Whether the fetch returns a padding mask: not where the pin's own six-value fetch ran (dev G2-G4b)."""


WORLD_4_LAYOUTS = (Layout(1, 2, 2), Layout(2, 1, 2), Layout(2, 2, 1), Layout(1, 1, 4), Layout(1, 4, 1))
"""Every tp·cp·dp layout of world size 4 with PP = 1."""
DYNAMIC_CP_LAYOUTS = (Layout(1, 2, 2), Layout(1, 4, 1), Layout(1, 1, 4), Layout(2, 2, 1))
"""Dynamic-CP layouts: pool dp·cp = 4 at TP 1, and pool 2 at TP 2."""


def standard_cases(*, steps: int = 3) -> list[Case]:
    """The end-to-end suite at world size 4: ``dp_balanced`` on every layout, dynamic CP where pools allow, and
    both with pre-packed items on some DP ranks and loosely built ones on others."""
    cases = [Case(layout, steps=steps) for layout in WORLD_4_LAYOUTS]
    cases.append(Case(Layout(1, 2, 2), steps=steps, samples_per_next=4, num_microbatches=2))
    mixed = ("prepacked", "loose")
    cases.append(Case(Layout(2, 1, 2), steps=steps, samples_per_next=2, num_microbatches=4, item_layouts=mixed))
    cases += [Case(layout, "default_dynamic_cp", dynamic_cp=True, steps=steps) for layout in DYNAMIC_CP_LAYOUTS]
    cases.append(Case(Layout(1, 2, 2), "default_dynamic_cp", dynamic_cp=True, min_dynamic_cp_size=2, steps=steps))
    cases.append(Case(Layout(1, 1, 4), "default_dynamic_cp", dynamic_cp=True, steps=steps, item_layouts=mixed))
    return cases


__all__ = [
    "Case",
    "CaseResult",
    "DYNAMIC_CP_LAYOUTS",
    "Fault",
    "Layout",
    "MicrobatchRecord",
    "RankStep",
    "WORLD_4_LAYOUTS",
    "standard_cases",
]
