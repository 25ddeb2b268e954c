"""Evals through the gateway. Errors are counted, never scored as wrong answers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import HarnessError
from ...load.load import RunReport


def without_logprobs(items: list[dict]) -> list[dict]:
    """Item records for result files: the per-token logprobs (and the whole answer text they
    are read against) stay in memory."""
    return [{k: v for k, v in it.items() if k not in ("logprobs", "text")} for it in items]


@dataclass
class EvalResult:
    name: str
    n: int                       # items asked
    correct: int
    errors: int                  # transport/HTTP errors: not scored
    formatted: int = 0           # scored items whose answer could be extracted
    error_samples: list[str] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)     # per item: index, prediction, ok
    wall_s: float = 0.0
    run: dict = field(default_factory=dict)

    @property
    def scored(self) -> int:
        return self.n - self.errors

    @property
    def accuracy(self) -> float:
        return self.correct / self.scored if self.scored else 0.0

    @property
    def format_rate(self) -> float:
        return self.formatted / self.scored if self.scored else 0.0

    def summary(self) -> dict:
        return {"eval": self.name, "n": self.n, "scored": self.scored, "correct": self.correct,
                "accuracy": round(self.accuracy, 4), "formatted": self.formatted,
                "format_rate": round(self.format_rate, 4), "errors": self.errors,
                "error_samples": self.error_samples[:3], "wall_s": round(self.wall_s, 2)}

    def check(self, floor: float | None = None, max_error_rate: float = 0.02,
              format_floor: float | None = None) -> None:
        """Fail above the error budget, then below the format floor, then below the accuracy
        floor (floors from the registry: model_specs.AccuracyFloor). An eval of no item is an
        error, whatever the floors: a verdict over nothing."""
        if self.n <= 0:
            raise HarnessError(f"{self.name}: no item was asked: nothing to judge")
        budget = int(max_error_rate * self.n)
        if self.errors > budget:
            raise HarnessError(f"{self.name}: {self.errors}/{self.n} requests failed (budget "
                               f"{budget}); first: {self.error_samples[:1]}")
        if format_floor is not None and self.format_rate < format_floor:
            raise HarnessError(f"{self.name}: {self.formatted}/{self.scored} outputs have an "
                               f"extractable answer, below the format floor {format_floor:.3f}")
        if floor is not None and self.accuracy < floor:
            raise HarnessError(f"{self.name}: accuracy {self.accuracy:.3f} below floor {floor} "
                               f"(n={self.scored})")

    def check_spec(self, acc) -> None:
        """check() with the floors of a registry entry (AccuracyFloor or None)."""
        self.check(floor=acc.floor if acc else None,
                   format_floor=acc.format_floor if acc else None)


def collect(name: str, report: RunReport, score) -> EvalResult:
    """score(result) -> (prediction, correct) for an ok result."""
    res = EvalResult(name=name, n=len(report.results), correct=0, errors=0, wall_s=report.wall_s,
                     run=report.summary())
    for r in report.results:
        if not r.ok:
            res.errors += 1
            res.error_samples.append(f"#{r.tag}: {r.status} {r.error[:160]}")
            res.items.append({"index": r.tag, "error": r.error[:200], "status": r.status})
            continue
        pred, ok = score(r)
        res.correct += int(ok)
        res.formatted += int(pred is not None)
        item = {"index": r.tag, "prediction": pred, "correct": ok, "output": r.text[:400]}
        if r.logprobs is not None:
            item["logprobs"] = r.logprobs
            item["text"] = r.text          # the oracle reads the steps against it
        res.items.append(item)
    return res
