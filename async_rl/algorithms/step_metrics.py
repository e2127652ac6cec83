"""Diagnostics of one learner step, reduced over micro-batches and ranks once.

Each diagnostic is a *figure*: a NamedTuple of additive sums with a `value()`. A rank
adds the figures of its micro-batches (and optimizer steps) under their final metric
keys; `StepMetrics.reduce` sums every figure over the ranks in one all_reduce and only
then computes the values, so each logged number describes the whole global batch
rather than an average of per-rank or per-micro-batch averages.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from async_rl.algorithms.normalization import ReduceSum


class Figure(Protocol):
    """Additive sums (a NamedTuple of floats) and the value they stand for."""

    def value(self) -> float: ...


class Mean(NamedTuple):
    """A weighted mean: `total` summed over `weight` units (response tokens, samples,
    optimizer steps)."""

    total: float
    weight: float

    @classmethod
    def of(cls, mean: float, weight: float) -> Mean:
        """A mean over `weight` units, kept as its total."""
        return cls(mean * weight, weight)

    def value(self) -> float:
        # A step whose every sample was filtered out has no units; its totals are 0 too.
        return self.total / max(self.weight, 1e-12)


class Count(NamedTuple):
    """How many times something happened in the step."""

    n: float

    def value(self) -> float:
        return round(self.n)


class StepMetrics:
    """Figures by metric key. Every rank must add the same keys with the same figure
    types (the reduction is one flat float64 vector); the order of adds is free."""

    def __init__(self) -> None:
        self._figures: dict[str, Figure] = {}

    def add(self, key: str, figure: Figure) -> None:
        old = self._figures.get(key, type(figure)(*([0.0] * len(figure))))
        self._figures[key] = type(figure)(*(a + b for a, b in zip(old, figure)))

    def update(self, figures: dict[str, Figure]) -> None:
        for key, figure in figures.items():
            self.add(key, figure)

    def zeros_into(self) -> StepMetrics:
        """A sink whose every add reaches this one as a zero figure of the same key and
        type: the work it records keeps the keys every rank must add, not its values."""
        return _ZeroSink(self)

    def reduce(self, reduce_sum: ReduceSum, device: torch.device | str = "cpu") -> dict[str, float]:
        """{key: value} of the figures summed over ranks by `reduce_sum` (an all_reduce)."""
        keys = sorted(self._figures)
        flat = torch.tensor([s for key in keys for s in self._figures[key]], dtype=torch.float64, device=device)
        sums = iter(reduce_sum(flat).tolist())
        out = {}
        for key in keys:
            figure = self._figures[key]
            out[key] = type(figure)(*(next(sums) for _ in figure)).value()
        return out


class _ZeroSink(StepMetrics):
    def __init__(self, target: StepMetrics) -> None:
        super().__init__()
        self._target = target

    def add(self, key: str, figure: Figure) -> None:
        self._target.add(key, type(figure)(*([0.0] * len(figure))))
