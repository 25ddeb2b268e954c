"""GSM8K and MMLU loaders.

Where the data comes from, in order:
  1. E2E_DATASET_DIR: gsm8k/{train,test}.jsonl, mmlu/{dev,test}.jsonl
  2. ../shared/datasets beside the checkout (SHARED: where CI and the scripts keep the copies),
     for a dataset whose files are all there
  3. the cache (E2E_CACHE_DIR/datasets), filled by `python -m e2e_test datasets download` from
     the public sources when online
Neither: a ConfigError naming both options.
Rows: GSM8K {"question", "answer"} (reference after "#### "); MMLU {"subject", "question",
"choices": [4], "answer": "A".."D"}.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..specs import settings
from ..specs.models import cache_dir

ENV = "E2E_DATASET_DIR"
# The offline copies beside the checkout (../shared/datasets), used when E2E_DATASET_DIR is unset.
SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "datasets"
FILES = {"gsm8k": ("train", "test"), "mmlu": ("dev", "test")}
GSM8K_URL = ("https://raw.githubusercontent.com/openai/grade-school-math/master/"
             "grade_school_math/data/{split}.jsonl")
MMLU_URL = "https://people.eecs.berkeley.edu/~hendrycks/data.tar"


@dataclass(frozen=True)
class GSM8KRow:
    question: str
    answer: str

    @property
    def reference(self) -> str:
        return self.answer.split("####")[-1].strip()


@dataclass(frozen=True)
class MMLURow:
    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str


def dataset_dir(name: str) -> Path:
    if name not in FILES:
        raise ConfigError(f"unknown dataset {name!r} (known: {', '.join(FILES)})")
    env = settings.raw(ENV)
    if env:
        d = Path(env) / name
        missing = [s for s in FILES[name] if not (d / f"{s}.jsonl").is_file()]
        if missing:
            raise ConfigError(f"{ENV}={env}: {d} lacks {', '.join(s + '.jsonl' for s in missing)}")
        for s in FILES[name]:
            if not os.access(d / f"{s}.jsonl", os.R_OK):
                raise ConfigError(f"{ENV}={env}: {d / (s + '.jsonl')} is not readable")
        return d
    if all((SHARED / name / f"{s}.jsonl").is_file() for s in FILES[name]):
        return SHARED / name
    d = cache_dir() / "datasets" / name
    if all((d / f"{s}.jsonl").is_file() for s in FILES[name]):
        return d
    raise ConfigError(f"no {name} data in {SHARED} nor the cache: set {ENV} to a folder with "
                      f"{name}/{{{','.join(FILES[name])}}}.jsonl, or run `python -m e2e_test datasets "
                      f"download` while online to fill {d.parent}")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ConfigError(f"{path}:{i}: not JSON ({e})") from None
    return rows


def load_gsm8k(split: str = "test") -> list[GSM8KRow]:
    path = dataset_dir("gsm8k") / f"{split}.jsonl"
    out = []
    for i, r in enumerate(_read_jsonl(path), 1):
        if not isinstance(r.get("question"), str) or "####" not in str(r.get("answer", "")):
            raise ConfigError(f"{path}:{i}: expected question and an answer with '#### '")
        out.append(GSM8KRow(r["question"], r["answer"]))
    return out


def load_mmlu(split: str = "test") -> list[MMLURow]:
    path = dataset_dir("mmlu") / f"{split}.jsonl"
    out = []
    for i, r in enumerate(_read_jsonl(path), 1):
        ch = r.get("choices")
        if (not isinstance(ch, list) or len(ch) != 4 or r.get("answer") not in ("A", "B", "C", "D")
                or not isinstance(r.get("question"), str)):
            raise ConfigError(f"{path}:{i}: expected subject, question, 4 choices, answer A-D")
        out.append(MMLURow(str(r.get("subject", "")), r["question"], tuple(ch), r["answer"]))
    return out


def download(dest: Path | None = None) -> Path:
    """Fetch the public copies into the cache (needs network)."""
    import httpx

    root = dest or cache_dir() / "datasets"
    (root / "gsm8k").mkdir(parents=True, exist_ok=True)
    (root / "mmlu").mkdir(parents=True, exist_ok=True)
    def get(c, url: str):
        """One URL; offline, refused or an HTTP error is one line (ConfigError, exit 2)."""
        try:
            r = c.get(url)
            r.raise_for_status()
            return r
        except httpx.HTTPError as e:
            why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"datasets download: cannot fetch {url} ({type(e).__name__}: "
                              f"{why[:160]}); offline? set E2E_DATASET_DIR to a folder with "
                              "gsm8k/{train,test}.jsonl and mmlu/{dev,test}.jsonl instead"
                              ) from None

    with httpx.Client(timeout=120, follow_redirects=True) as c:
        for split in ("train", "test"):
            r = get(c, GSM8K_URL.format(split=split))
            (root / "gsm8k" / f"{split}.jsonl").write_bytes(r.content)
        r = get(c, MMLU_URL)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        for split in ("dev", "test"):
            rows = []
            members = sorted((m for m in tar.getmembers()
                              if m.name.startswith(f"data/{split}/") and m.name.endswith(".csv")),
                             key=lambda m: m.name)
            for m in members:
                subject = Path(m.name).stem.rsplit(f"_{split}", 1)[0]
                text = tar.extractfile(m).read().decode("utf-8")
                for rec in csv.reader(io.StringIO(text)):
                    rows.append({"subject": subject, "question": rec[0], "choices": rec[1:5],
                                 "answer": rec[5]})
            with open(root / "mmlu" / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
    return root
