"""Length distributions for workloads, parsed from short specs like `uniform:300:700`.

Specs: `fixed:N`, `uniform:LO:HI` (integers, inclusive), `normal:MEAN:STD`, `lognormal:MEDIAN:SIGMA`,
`spread:MEAN:PCT` (uniform on MEAN × (1 ± PCT/100): the seed's "output-length spread"). Every draw is at
least 1 token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtune.errors import KvtuneError

KINDS = ("fixed", "uniform", "normal", "lognormal", "spread")


@dataclass(frozen=True)
class LengthDistribution:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        parts = spec.strip().split(":")
        kind, args = parts[0].lower(), parts[1:]
        want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "spread": 2}
        if kind not in want:
            raise KvtuneError(f"unknown distribution {kind!r} in {spec!r} (choose from {', '.join(KINDS)})")
        if len(args) != want[kind]:
            raise KvtuneError(f"distribution {spec!r}: {kind} takes {want[kind]} number(s), got {len(args)}")
        try:
            values = [float(x) for x in args]
        except ValueError:
            raise KvtuneError(f"distribution {spec!r}: arguments must be numbers") from None
        dist = cls(kind, *values)
        dist.validate(spec)
        return dist

    def validate(self, spec: str = "") -> None:
        label = spec or self.describe()
        a, b = self.a, self.b
        if not np.isfinite(a) or not np.isfinite(b):
            raise KvtuneError(f"distribution {label!r}: arguments must be finite")
        if self.kind in ("fixed", "normal", "lognormal", "spread") and a < 1:
            raise KvtuneError(f"distribution {label!r}: the length must be at least 1")
        if self.kind == "uniform" and not 1 <= a <= b:
            raise KvtuneError(f"distribution {label!r}: need 1 <= LO <= HI")
        if self.kind in ("normal", "lognormal") and b < 0:
            raise KvtuneError(f"distribution {label!r}: the spread must be non-negative")
        if self.kind == "spread" and not 0 <= b <= 100:
            raise KvtuneError(f"distribution {label!r}: the spread is a percentage, 0 to 100")

    def describe(self) -> str:
        return f"{self.kind}:" + ":".join(
            f"{v:g}" for v in ((self.a,) if self.kind == "fixed" else (self.a, self.b))
        )

    @property
    def mean(self) -> float:
        if self.kind in ("fixed", "normal", "spread"):
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(self.a * np.exp(self.b**2 / 2))

    @property
    def maximum(self) -> float:
        """The largest value a draw can take (infinite for the unbounded kinds)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return self.b
        if self.kind == "spread":
            return round(self.a * (1 + self.b / 100))
        return float("inf")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        elif self.kind == "lognormal":
            x = rng.lognormal(np.log(self.a), self.b, size=n)
        else:
            lo, hi = round(self.a * (1 - self.b / 100)), round(self.a * (1 + self.b / 100))
            x = rng.integers(lo, hi + 1, size=n)
        lengths: np.ndarray = np.maximum(1, np.rint(x)).astype(np.int64)
        return lengths
