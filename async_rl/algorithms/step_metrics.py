"""Diagnostics of one learner step, reduced over micro-batches and ranks once.

Each diagnostic is a *figure*: a tuple of additive sums with a `value()` (`Max` alone
combines by the largest). A rank adds the figures of its micro-batches (and optimizer
steps) under their final metric keys; `StepMetrics.reduce` sums every figure over the
ranks in one all_reduce (and takes the `Max` figures' largest in another) and only then
computes the values, so each logged number describes the whole global batch rather than
an average of per-rank or per-micro-batch averages.
"""

from __future__ import annotations

import math
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


class Max(NamedTuple):
    """The largest value seen; 0 when nothing was."""

    largest: float

    def value(self) -> float:
        return self.largest if math.isfinite(self.largest) else 0.0


class Quantile(tuple):
    """The q-quantile of values counted in the equal bins of [low, high] (values outside
    count in the end bins): the counts add over micro-batches and ranks, so the quantile
    is of the whole batch, exact to half a bin. `value()` is the middle of the bin the
    quantile falls in, through `transform` (e.g. exp, for a ratio binned by its log)."""

    def __new__(cls, counts, q: float, low: float, high: float, transform=None):
        obj = super().__new__(cls, counts)
        obj.q, obj.low, obj.high, obj.transform = q, low, high, transform
        return obj

    @staticmethod
    def counts(values: torch.Tensor, low: float, high: float, bins: int) -> list[float]:
        """The histogram several quantiles of the same values share."""
        width = (high - low) / bins
        index = ((values.double() - low) / width).floor().clamp(0, bins - 1).long()
        return [float(c) for c in torch.bincount(index, minlength=bins).tolist()]

    def _make(self, sums) -> Quantile:
        return Quantile(list(sums), self.q, self.low, self.high, self.transform)

    def value(self) -> float:
        counts = torch.tensor(self, dtype=torch.float64)
        total = float(counts.sum())
        if total == 0:
            return 0.0
        rank = max(1.0, math.ceil(self.q * total))  # the smallest value with at least q of the mass at or below it
        bin_index = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor([rank], dtype=torch.float64)))
        width = (self.high - self.low) / len(self)
        middle = self.low + (bin_index + 0.5) * width
        return float(self.transform(middle)) if self.transform else middle


def _zero(figure: Figure) -> Figure:
    return type(figure)(-math.inf) if isinstance(figure, Max) else figure._make([0.0] * len(figure))


def _combined(old: Figure, new: Figure) -> Figure:
    if isinstance(new, Max):
        return type(new)(max(old.largest, new.largest))
    return new._make(a + b for a, b in zip(old, new))


class StepMetrics:
    """Figures by metric key. Every rank must add the same keys with the same figure
    types (the reduction is one flat float64 vector); the order of adds is free."""

    def __init__(self) -> None:
        self._figures: dict[str, Figure] = {}

    def add(self, key: str, figure: Figure) -> None:
        self._figures[key] = _combined(self._figures.get(key, _zero(figure)), figure)

    def update(self, figures: dict[str, Figure]) -> None:
        for key, figure in figures.items():
            self.add(key, figure)

    def zeros_into(self) -> StepMetrics:
        """A sink whose every add reaches this one as a zero figure of the same key and
        type: the work it records keeps the keys every rank must add, not its values."""
        return _ZeroSink(self)

    def reduce(self, reduce_sum: ReduceSum, device: torch.device | str = "cpu",
               reduce_max: ReduceSum | None = None) -> dict[str, float]:
        """{key: value} of the figures summed over ranks by `reduce_sum` (an all_reduce),
        the `Max` figures' largest taken by `reduce_max` (none needed with one rank)."""
        out = {}
        for of_max, reduce in ((False, reduce_sum), (True, reduce_max)):
            keys = sorted(k for k, f in self._figures.items() if isinstance(f, Max) == of_max)
            if not keys:
                continue
            flat = torch.tensor([s for key in keys for s in self._figures[key]], dtype=torch.float64, device=device)
            reduced = iter((flat if reduce is None else reduce(flat)).tolist())
            for key in keys:
                figure = self._figures[key]
                out[key] = figure._make(next(reduced) for _ in figure).value()
        return dict(sorted(out.items()))


class _ZeroSink(StepMetrics):
    def __init__(self, target: StepMetrics) -> None:
        super().__init__()
        self._target = target

    def add(self, key: str, figure: Figure) -> None:
        self._target.add(key, _zero(figure))
