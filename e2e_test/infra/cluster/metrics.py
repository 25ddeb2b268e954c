"""Prometheus scraping: one sample lookup API over prometheus_client's parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value}"""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple], float]:
    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return parse(r.text)


def read_multiproc_dir(path: str) -> dict[tuple[str, tuple], float]:
    """Samples from a Prometheus multiprocess folder (engines that write metrics there but
    serve no /metrics, like TokenSpeed behind its gRPC servicer)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return parse(generate_latest(registry).decode())


def total(samples: dict, name: str, **labels) -> float:
    """Sum of every sample called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)
