"""Parquet prompt data: schema checks at load, and a seeded loader that resumes exactly."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from siirl_dag.data import PromptDataset, PromptLoader, row_cache
from siirl_dag.errors import ConfigError


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def verl_file(tmp_path, n=10, name="train.parquet"):
    return write(tmp_path / name,
                 prompt=[f"Q: {i}+1=? A:" for i in range(n)],
                 data_source=["demo/arith"] * n,
                 reward_model=[{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
                 extra_info=[{"split": "train", "index": i} for i in range(n)])


def test_loads_verl_layout_and_chat_prompts(tmp_path):
    a = verl_file(tmp_path, n=3)
    b = write(tmp_path / "chat.parquet",
              question=[[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2"}]],
              data_source=["openai/gsm8k"] * 2, ground_truth=["1", "4"])
    ds = PromptDataset([a], "prompt")
    assert len(ds) == 3
    assert ds[1] == {"raw_prompt": "Q: 1+1=? A:", "data_source": "demo/arith", "ground_truth": "2",
                     "extra_info": {"split": "train", "index": 1}, "index": 1}
    chat = PromptDataset(b, prompt_key="question")
    assert chat[1]["raw_prompt"][1] == {"role": "user", "content": "2+2"}
    assert chat[1]["extra_info"] == {} and chat[1]["ground_truth"] == "4"


def test_index_runs_over_all_files(tmp_path):
    files = [verl_file(tmp_path, 3, "a.parquet"), str(tmp_path / "empty.parquet"), verl_file(tmp_path, 2, "b.parquet")]
    pq.write_table(pq.read_table(files[0]).slice(0, 0), files[1])
    ds = PromptDataset(files)
    assert [r["index"] for r in ds.rows] == [0, 1, 2, 3, 4]
    assert ds[3]["raw_prompt"] == "Q: 0+1=? A:"
    assert [ds.source(i) for i in (0, 2, 3, 4)] == [(files[0], 0), (files[0], 2), (files[2], 0), (files[2], 1)]


def test_bad_rows_reported_together_with_file_row_and_column(tmp_path):
    path = write(tmp_path / "bad.parquet",
                 prompt=["ok", None, "", "ok"],
                 data_source=["gsm8k", "gsm8k", "gsm8k", None],
                 reward_model=[{"ground_truth": "1"}, {"ground_truth": "2"}, {"ground_truth": "3"}, {"ground_truth": None}])
    with pytest.raises(ConfigError) as err:
        PromptDataset(path)
    lines = str(err.value).splitlines()
    assert lines == [
        f"{path}: rows[1].prompt: is null; expected a non-empty string or a chat list of {{role, content}} messages",
        f"{path}: rows[2].prompt: is an empty string; expected a non-empty string or a chat list of {{role, content}} messages",
        f"{path}: rows[3].data_source: is null or empty; expected the name of the data set",
        f"{path}: rows[3].reward_model.ground_truth: is null or empty; expected the reference answer",
    ]


def test_bad_columns(tmp_path):
    path = write(tmp_path / "cols.parquet", text=[1, 2], data_source=["x", "y"], ground_truth=["1", "2"])
    with pytest.raises(ConfigError, match=r"prompt: column is missing \(columns: text, data_source, ground_truth\)"):
        PromptDataset(path)
    with pytest.raises(ConfigError, match="text: has type int64; expected a non-empty string or a chat list"):
        PromptDataset(path, prompt_key="text")
    no_truth = write(tmp_path / "nt.parquet", prompt=["a"], data_source=["x"])
    with pytest.raises(ConfigError, match="ground_truth: column is missing; expected reward_model.ground_truth or ground_truth"):
        PromptDataset(no_truth)
    bad_chat = write(tmp_path / "chat.parquet", prompt=[[{"role": "user", "content": None}]], data_source=["x"], ground_truth=["1"])
    with pytest.raises(ConfigError, match=r"rows\[0\].prompt: message 0 lacks a string 'role' or 'content'"):
        PromptDataset(bad_chat)


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_files\[1\]: data file '.*nope.parquet' does not exist"):
        PromptDataset([verl_file(tmp_path), str(tmp_path / "nope.parquet")], config_path=("data", "train_files"))
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ConfigError, match="is not readable parquet"):
        PromptDataset(str(junk))


def test_a_directory_is_not_a_data_file(tmp_path):
    folder = tmp_path / "train.parquet"
    folder.mkdir()
    verl_file(folder, name="part0.parquet")
    with pytest.raises(ConfigError) as err:
        PromptDataset([str(folder)], config_path=("data", "train_files"))
    assert str(err.value) == (f"data.train_files: data file '{folder}' is a directory; expected a parquet file "
                              "(list the files inside it one by one)")


def test_damaged_pages_behind_a_sound_footer(tmp_path):
    path = verl_file(tmp_path, n=200)
    data = bytearray(Path(path).read_bytes())
    data[40:400] = b"\xff" * 360  # the first column's pages; the footer at the end stays readable
    Path(path).write_bytes(data)
    pq.read_schema(path)
    with pytest.raises(ConfigError) as err:
        PromptDataset([path], config_path=("data", "val_files"))
    assert str(err.value).startswith(f"data.val_files: data file '{path}' is not readable parquet (")
    assert str(err.value).endswith("); expected an intact parquet file")


def ids(batches):
    return [[r["index"] for r in b] for b in batches]


def test_measured_rows_are_kept_for_later_runs(tmp_path, monkeypatch):
    """row_cache: a row measured once under the same files and `what` is not measured again, in this
    process or a later one; a changed file, or another `what`, is measured afresh."""
    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(row_cache, "_MEMORY", {})
    asked = []

    def measure(rows):
        asked.append([row["index"] for row in rows])
        return [len(row["raw_prompt"]) for row in rows]

    data = PromptDataset([verl_file(tmp_path, n=12)], "prompt")
    data.drop({0, 5})
    want = [len(row["raw_prompt"]) for row in data.rows]
    assert row_cache.measured(data, {"v": 1}, measure, "lengths") == want and asked == [[i for i in range(12) if i not in (0, 5)]]
    assert row_cache.measured(data, {"v": 1}, measure, "lengths") == want and len(asked) == 1
    monkeypatch.setattr(row_cache, "_MEMORY", {})  # a new process: from the disk
    assert row_cache.measured(data, {"v": 1}, measure, "lengths") == want and len(asked) == 1
    whole = PromptDataset([verl_file(tmp_path, n=13)], "prompt")  # the file written again: a new key
    assert row_cache.measured(whole, {"v": 1}, measure, "lengths")[:2] == [len("Q: 0+1=? A:")] * 2 and len(asked[1]) == 13
    assert row_cache.measured(whole, {"v": 2}, measure, "lengths") and len(asked) == 3
    assert row_cache.measured(whole, None, measure, "lengths") and len(asked) == 4  # None: this process only
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 3


def test_a_rewrite_that_keeps_size_and_times_is_measured_again(tmp_path, monkeypatch):
    """A data file regenerated at the same size and given back its old times (as `cp -p` or `rsync -t`
    would) must not read the old file's numbers."""
    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(row_cache, "_MEMORY", {})
    path = tmp_path / "train.parquet"

    def rewrite(*prompts):
        write(path, prompt=list(prompts), data_source=["demo/arith"] * 2,
              reward_model=[{"style": "rule", "ground_truth": "1"}] * 2, extra_info=[{"split": "train"}] * 2)

    rewrite("aaaa", "bb")
    before = path.stat()
    assert row_cache.measured(PromptDataset([str(path)], "prompt"), {}, lambda rows: [len(r["raw_prompt"]) for r in rows], "lengths") == [4, 2]
    time.sleep(0.01)  # a change time the clock can tell apart
    rewrite("bb", "aaaa")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert row_cache.measured(PromptDataset([str(path)], "prompt"), {}, lambda rows: [len(r["raw_prompt"]) for r in rows], "lengths") == [2, 4]


def test_the_row_cache_keeps_the_entries_used_last(tmp_path, monkeypatch):
    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(row_cache, "KEEP", 2)
    data, asked = PromptDataset([verl_file(tmp_path, n=4)], "prompt"), []

    def measure(rows):
        asked.append(len(rows))
        return [1] * len(rows)

    def in_a_new_process(v) -> int:
        monkeypatch.setattr(row_cache, "_MEMORY", {})
        time.sleep(0.05)  # file times tick coarsely
        row_cache.measured(data, {"v": v}, measure, "ones")
        return len(asked)

    # 1 is read (used) after 2 was written: writing 3 drops 2
    assert [in_a_new_process(v) for v in (1, 2, 1, 3)] == [1, 2, 2, 3]
    assert [in_a_new_process(v) for v in (1, 2)] == [3, 4] and len(list((tmp_path / "cache").glob("*.npy"))) == 2


def test_a_damaged_or_unwritable_row_cache_only_costs_time(tmp_path, monkeypatch):
    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(row_cache, "_MEMORY", {})
    data, asked = PromptDataset([verl_file(tmp_path, n=4)], "prompt"), []

    def measure(rows):
        asked.append(len(rows))
        return [7] * len(rows)

    assert row_cache.measured(data, {}, measure, "sevens") == [7] * 4
    (entry,) = (tmp_path / "cache").glob("*.npy")
    entry.write_bytes(entry.read_bytes()[:20])
    monkeypatch.setattr(row_cache, "_MEMORY", {})
    assert row_cache.measured(data, {}, measure, "sevens") == [7] * 4 and asked == [4, 4]
    monkeypatch.setattr(row_cache, "_MEMORY", {})
    (tmp_path / "blocked").write_text("a file where the folder would be")
    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "blocked"))
    assert row_cache.measured(data, {}, measure, "sevens") == [7] * 4 and asked == [4, 4, 4]


def test_shuffle_is_seeded_per_epoch_and_ignores_global_rng(tmp_path):
    ds = PromptDataset(verl_file(tmp_path, n=10))
    np.random.seed(1)
    first = ids(PromptLoader(ds, batch_size=3, seed=5))
    np.random.seed(2)
    again = ids(PromptLoader(ds, batch_size=3, seed=5))
    assert first == again
    assert len(first) == 3 and all(len(b) == 3 for b in first)  # drop_last: 9 of 10 rows
    assert len({i for b in first for i in b}) == 9
    assert first != ids(PromptLoader(ds, batch_size=3, seed=6))
    loader = PromptLoader(ds, batch_size=3, seed=5)
    epoch0, epoch1 = ids(loader), ids(loader)
    assert epoch0 == first and epoch1 != epoch0 and loader.epoch == 2


def test_no_shuffle_keeps_last_partial_batch(tmp_path):
    loader = PromptLoader(PromptDataset(verl_file(tmp_path, n=5)), batch_size=2, shuffle=False, drop_last=False)
    assert len(loader) == 3
    assert ids(loader) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 7])  # mid-epoch, epoch boundary, across epochs
def test_resume_continues_exactly(tmp_path, stop_after):
    ds = PromptDataset(verl_file(tmp_path, n=13))  # 4 batches of 3 per epoch, one row dropped
    uninterrupted = PromptLoader(ds, batch_size=3, seed=11)
    reference = ids(uninterrupted.next_batch() for _ in range(10))

    first = PromptLoader(ds, batch_size=3, seed=11)
    seen = ids(first.next_batch() for _ in range(stop_after))
    state = first.state_dict()
    resumed = PromptLoader(ds, batch_size=3, seed=11)
    resumed.load_state_dict(dict(state))
    seen += ids(resumed.next_batch() for _ in range(10 - stop_after))
    assert seen == reference


def test_resume_refuses_other_data_or_seed(tmp_path):
    state = PromptLoader(PromptDataset(verl_file(tmp_path, n=10)), batch_size=2, seed=1).state_dict()
    other = PromptLoader(PromptDataset(verl_file(tmp_path, n=12, name="b.parquet")), batch_size=2, seed=1)
    with pytest.raises(ConfigError, match="num_rows 10 then, 12 now"):
        other.load_state_dict(state)
    reseeded = PromptLoader(PromptDataset(verl_file(tmp_path, n=10, name="c.parquet")), batch_size=2, seed=2)
    with pytest.raises(ConfigError, match="seed 1 then, 2 now"):
        reseeded.load_state_dict(state)


@pytest.mark.parametrize("change, message", [
    ({"epoch": None}, "<root>: the loader state lacks epoch; expected a mapping with epoch, position, seed, num_rows, shuffle"),
    ({"position": -2}, "position: position -2 is not a count; expected a non-negative 64-bit integer"),
    ({"epoch": True}, "epoch: epoch True is not a count; expected a non-negative 64-bit integer"),
    ({"position": 10}, "position: position 10 is outside an epoch of 10 rows; expected the same batch layout as the checkpoint"),
])
def test_resume_refuses_a_malformed_state_naming_the_field(tmp_path, change, message):
    loader = PromptLoader(PromptDataset(verl_file(tmp_path, n=10)), batch_size=2)
    state = {k: v for k, v in {**loader.state_dict(), **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        loader.load_state_dict(state)
    assert str(err.value) == message
    assert (loader.epoch, loader.position) == (0, 0)


def test_too_few_rows_for_one_batch(tmp_path):
    with pytest.raises(ConfigError, match="3 rows, fewer than one batch of 4"):
        PromptLoader(PromptDataset(verl_file(tmp_path, n=3)), batch_size=4)


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / args[0]), *map(str, args[1:])], check=True,
                          capture_output=True, text=True).stdout


def test_convert_gsm8k_jsonl_and_hf_parquet(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"},
            {"question": "What is 2-5?", "answer": "#### -3"}]
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    for split in ("train", "test"):
        (jsonl / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (jsonl / f"{split}_socratic.jsonl").write_text("not json")  # must be ignored
    hf = tmp_path / "hf" / "main"
    hf.mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), hf / f"{split}-00000-of-00001.parquet")
    for src in (jsonl, tmp_path / "hf"):
        out = tmp_path / f"out_{src.name}"
        assert "train: 2 rows test: 2 rows" in run_script("convert_gsm8k.py", src, out)
        ds = PromptDataset(str(out / "test.parquet"))
        assert [r["ground_truth"] for r in ds.rows] == ["1003", "-3"]
        assert ds[0]["data_source"] == "openai/gsm8k"
        message = ds[0]["raw_prompt"][0]
        assert message["role"] == "user" and message["content"].startswith("Tom has 3 apples")
        assert '"####"' in message["content"]


def test_convert_gsm8k_without_data_fails_clearly(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPTS / "convert_gsm8k.py"), str(tmp_path), str(tmp_path / "o")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "no train" in result.stderr


def test_demo_task_data(tmp_path):
    run_script("make_demo_task.py", tmp_path, "--data-only", "--seed", 3)
    train, test = PromptDataset(str(tmp_path / "train.parquet")), PromptDataset(str(tmp_path / "test.parquet"))
    assert (len(train), len(test)) == (9800, 200)
    questions = {r["raw_prompt"] for r in train.rows}
    assert not questions & {r["raw_prompt"] for r in test.rows}  # held-out pairs
    row = test[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["raw_prompt"] == f"Q: {a}+{b}=? A:" and row["ground_truth"] == str(a + b)
    assert row["data_source"] == "demo/arith" and 0 <= a <= 99 and 0 <= b <= 99
    assert "exist, skipped" in run_script("make_demo_task.py", tmp_path, "--data-only")
