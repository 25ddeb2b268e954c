"""GSM8K/MMLU loaders on the real offline copies, and one-line ConfigErrors for bad folders."""

import json
from pathlib import Path

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.verdicts import datasets
from e2e_test.infra.verdicts.datasets import GSM8KRow, MMLURow, dataset_dir, load_gsm8k, load_mmlu


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def write_dataset(root, gsm8k_rows=None, mmlu_rows=None):
    """A minimal dataset folder: both splits of both datasets, one good row each."""
    g = gsm8k_rows or [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
    m = mmlu_rows or [{"subject": "math", "question": "1+1?", "choices": ["1", "2", "3", "4"],
                       "answer": "B"}]
    for name, splits, rows in (("gsm8k", ("train", "test"), g), ("mmlu", ("dev", "test"), m)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for s in splits:
            (root / name / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


# -- the real folder --------------------------------------------------------------------------

def test_real_gsm8k(real_datasets):
    assert dataset_dir("gsm8k") == real_datasets / "gsm8k"
    test, train = load_gsm8k("test"), load_gsm8k("train")
    assert (len(test), len(train)) == (1319, 7473)
    assert isinstance(test[0], GSM8KRow)
    assert test[0].question.startswith("Janet")
    assert test[0].reference == "18"


def test_real_mmlu(real_datasets):
    test, dev = load_mmlu("test"), load_mmlu("dev")
    assert (len(test), len(dev)) == (14042, 285)
    assert isinstance(dev[0], MMLURow)
    assert dev[0].subject == "abstract_algebra"
    assert dev[0].choices == ("0", "1", "2", "3") and dev[0].answer == "B"
    assert len({r.subject for r in test}) == 57
    assert {r.answer for r in test} == {"A", "B", "C", "D"}
    assert all(len(r.choices) == 4 for r in test)


def test_tiny_folder_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_DATASET_DIR", str(write_dataset(tmp_path)))
    assert load_gsm8k("train") == [GSM8KRow("1+1?", "1+1=2\n#### 2")]
    assert load_mmlu("dev") == [MMLURow("math", "1+1?", ("1", "2", "3", "4"), "B")]


def test_blank_lines_are_skipped(tmp_path, monkeypatch):
    write_dataset(tmp_path)
    p = tmp_path / "gsm8k" / "test.jsonl"
    p.write_text("\n" + p.read_text() + "\n\n")
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    assert len(load_gsm8k("test")) == 1


# -- errors -----------------------------------------------------------------------------------

def test_dataset_dir_without_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_gsm8k("test")
    msg = one_line(ei)
    assert msg == (f"E2E_DATASET_DIR={tmp_path}: {tmp_path / 'gsm8k'} lacks train.jsonl, "
                   "test.jsonl")


def test_dataset_dir_missing_one_split(tmp_path, monkeypatch):
    write_dataset(tmp_path)
    (tmp_path / "mmlu" / "dev.jsonl").unlink()
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_mmlu("test")
    assert one_line(ei).endswith("mmlu lacks dev.jsonl")


def test_unknown_dataset():
    with pytest.raises(ConfigError, match="unknown dataset 'hellaswag'"):
        dataset_dir("hellaswag")


def test_malformed_jsonl_line(tmp_path, monkeypatch):
    write_dataset(tmp_path)
    p = tmp_path / "gsm8k" / "test.jsonl"
    p.write_text(p.read_text() + '{"question": "oops", "answer": \n')
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_gsm8k("test")
    assert one_line(ei).startswith(f"{p}:2: not JSON (")


def test_gsm8k_row_without_marker(tmp_path, monkeypatch):
    write_dataset(tmp_path, gsm8k_rows=[{"question": "q", "answer": "#### 1"},
                                        {"question": "q", "answer": "just 2"}])
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_gsm8k("test")
    assert one_line(ei) == (f"{tmp_path / 'gsm8k' / 'test.jsonl'}:2: expected question and an "
                            "answer with '#### '")


def test_gsm8k_row_without_question(tmp_path, monkeypatch):
    write_dataset(tmp_path, gsm8k_rows=[{"answer": "#### 1"}])
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"test.jsonl:1: expected question"):
        load_gsm8k("test")


@pytest.mark.parametrize("row", [
    {"subject": "s", "question": "q", "choices": ["a", "b", "c"], "answer": "A"},
    {"subject": "s", "question": "q", "choices": ["a", "b", "c", "d"], "answer": "E"},
    {"subject": "s", "question": "q", "choices": ["a", "b", "c", "d"], "answer": 1},
    {"subject": "s", "choices": ["a", "b", "c", "d"], "answer": "A"},
    {"subject": "s", "question": "q", "choices": "abcd", "answer": "A"},
])
def test_bad_mmlu_row(tmp_path, monkeypatch, row):
    write_dataset(tmp_path, mmlu_rows=[row])
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_mmlu("dev")
    assert one_line(ei) == (f"{tmp_path / 'mmlu' / 'dev.jsonl'}:1: expected subject, question, "
                            "4 choices, answer A-D")


def test_no_env_and_empty_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("E2E_DATASET_DIR", raising=False)
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(datasets, "SHARED", tmp_path / "shared" / "datasets")
    with pytest.raises(ConfigError) as ei:
        load_gsm8k("test")
    msg = one_line(ei)
    assert "E2E_DATASET_DIR" in msg and "datasets download" in msg
    assert msg == (f"no gsm8k data in {tmp_path / 'shared' / 'datasets'} nor the cache: set "
                   "E2E_DATASET_DIR to a folder with gsm8k/{train,test}.jsonl, "
                   f"or run `python -m e2e_test datasets download` while online to fill "
                   f"{tmp_path / 'datasets'}")
    with pytest.raises(ConfigError, match=r"no mmlu data .*mmlu/\{dev,test\}\.jsonl"):
        load_mmlu("test")


def test_cache_is_used_without_env(tmp_path, monkeypatch):
    monkeypatch.delenv("E2E_DATASET_DIR", raising=False)
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(datasets, "SHARED", tmp_path / "shared" / "datasets")
    write_dataset(tmp_path / "datasets")
    assert dataset_dir("mmlu") == tmp_path / "datasets" / "mmlu"
    assert load_gsm8k("test")[0].reference == "2"


def test_shared_datasets_beside_the_checkout_are_found_without_env(tmp_path, monkeypatch):
    """../shared/datasets (where CI and the scripts keep the copies) is used when
    E2E_DATASET_DIR is unset, before the cache; a dataset it lacks comes from the cache."""
    assert datasets.SHARED == Path(datasets.__file__).resolve().parents[4] / "shared" / "datasets"
    monkeypatch.delenv("E2E_DATASET_DIR", raising=False)
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path / "cache"))
    write_dataset(tmp_path / "cache" / "datasets")
    shared = tmp_path / "shared" / "datasets"
    write_dataset(shared)
    (shared / "mmlu" / "test.jsonl").unlink()              # mmlu incomplete there
    monkeypatch.setattr(datasets, "SHARED", shared)
    assert dataset_dir("gsm8k") == shared / "gsm8k"
    assert dataset_dir("mmlu") == tmp_path / "cache" / "datasets" / "mmlu"
    # an explicit E2E_DATASET_DIR still wins
    monkeypatch.setenv("E2E_DATASET_DIR", str(tmp_path / "cache" / "datasets"))
    assert dataset_dir("gsm8k") == tmp_path / "cache" / "datasets" / "gsm8k"


def test_env_var_name():
    assert datasets.ENV == "E2E_DATASET_DIR"
