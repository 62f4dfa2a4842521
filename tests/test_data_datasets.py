"""Dataset files and the prompt stream: bad input, shuffling, sharding, exact resume."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelinerl_jax.data.datasets import DatasetSpec, PromptStream, load_dataset, load_problems
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data")


def _problems(n, source="toy"):
    return tuple(
        Problem(uid=f"{source}/{i}", question=f"q{i}", answer=str(i), source=source)
        for i in range(n)
    )


def _uids(stream, n):
    return [next(stream).uid for _ in range(n)]


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


# ----- loading -------------------------------------------------------------------------------


def test_parquet_written_by_the_test(tmp_path):
    table = pa.table(
        {
            "prompt": ["1+1?", "2+3?", "7*6?"],
            "target": [2, 5, 42],
            "meta": [{"k": 1}, {"k": 2}, {"k": 3}],
        }
    )
    pq.write_table(table, tmp_path / "arith.parquet")
    loaded = load_dataset(
        DatasetSpec(
            path=str(tmp_path / "arith.parquet"),
            format="fields",
            question_field="prompt",
            answer_field="target",
        )
    )
    assert [(p.question, p.answer) for p in loaded.problems] == [
        ("1+1?", "2"),
        ("2+3?", "5"),
        ("7*6?", "42"),
    ]
    # A directory (e.g. sharded parquet files) and a glob both read all files in name order.
    pq.write_table(table.slice(0, 1), tmp_path / "b.parquet")
    by_dir = load_dataset(
        DatasetSpec(path=str(tmp_path), question_field="prompt", answer_field="target", name="d")
    )
    by_glob = load_dataset(
        DatasetSpec(
            path=str(tmp_path / "*.parquet"),
            question_field="prompt",
            answer_field="target",
            name="d",
        )
    )
    assert len(by_dir.problems) == len(by_glob.problems) == 4
    assert [p.uid for p in by_dir.problems] == [f"d/{i}" for i in range(4)]


def test_bad_records_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    _write_jsonl(
        path,
        [
            {"question": "ok 1", "answer": "1"},
            {"prompt": "wrong key", "answer": "2"},
            "{not json",
            {"question": "no answer"},
            {"question": "", "answer": "3"},
            {"question": "ok 2", "answer": 4},
            "",
        ],
    )
    loaded = load_dataset(DatasetSpec(path=str(path)))
    assert [p.question for p in loaded.problems] == ["ok 1", "ok 2"]
    # Rows keep their position in the file (uids are stable whatever gets skipped).
    assert [p.uid for p in loaded.problems] == ["mixed/0", "mixed/5"]
    assert loaded.num_records == 6 and loaded.num_skipped == 4
    assert loaded.skipped == {
        "missing question field 'question'": 1,
        "invalid JSON line": 1,
        "missing answer field 'answer'": 1,
        "empty or non-text question": 1,
    }
    assert "skipped 4 of 6 records" in caplog.text


def test_all_bad_records_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, [{"q": "a", "a": "1"}, {"q": "b", "a": "2"}])
    with pytest.raises(ConfigError, match="none of its 2 records") as e:
        load_dataset(DatasetSpec(path=str(path)))
    assert "['a', 'q']" in str(e.value) and "\n" not in str(e.value)
    # A GSM8K file read as MATH: every record lacks 'problem'.
    with pytest.raises(ConfigError, match="format 'math'"):
        load_dataset(DatasetSpec(path=os.path.join(DATA, "gsm8k.jsonl"), format="math"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_dataset(DatasetSpec(path=str(empty)))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="dataset file not found: .*nope.jsonl") as e:
        load_dataset(DatasetSpec(path=str(tmp_path / "nope.jsonl")))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no dataset files"):
        load_dataset(DatasetSpec(path=str(tmp_path / "*.jsonl")))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported extension"):
        load_dataset(DatasetSpec(path=str(tmp_path / "data.csv")))
    (tmp_path / "obj.json").write_text('{"question": "x"}')
    with pytest.raises(ConfigError, match="expected a list"):
        load_dataset(DatasetSpec(path=str(tmp_path / "obj.json")))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="cannot read Parquet file"):
        load_dataset(DatasetSpec(path=str(tmp_path / "broken.parquet")))


# ----- the stream ----------------------------------------------------------------------------


def test_shuffle_is_deterministic_and_changes_every_epoch():
    source = _problems(50)
    a = _uids(PromptStream(source, seed=7), 150)
    b = _uids(PromptStream(source, seed=7), 150)
    c = _uids(PromptStream(source, seed=8), 150)
    assert a == b and a != c
    epochs = [a[i * 50 : (i + 1) * 50] for i in range(3)]
    for epoch in epochs:  # every epoch is a permutation of the whole dataset
        assert sorted(epoch) == sorted(p.uid for p in source)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert _uids(PromptStream(source, shuffle=False), 60) == [f"toy/{i % 50}" for i in range(60)]


def test_epoch_and_index_stamps_and_finite_epochs():
    stream = PromptStream(_problems(4), seed=0, num_epochs=2)
    drawn = list(stream)
    assert [(p.epoch, p.index) for p in drawn] == [(i // 4, i) for i in range(8)]
    assert stream.position == 8 and stream.epoch == 2


@pytest.mark.parametrize("n, count", [(30, 3), (31, 4)])
def test_shards_are_disjoint_and_cover_the_data(n, count):
    source = _problems(n)
    shards = [PromptStream(source, seed=3, shard_index=i, shard_count=count) for i in range(count)]
    seen = [set(_uids(s, s.epoch_size)) for s in shards]
    assert sum(s.epoch_size for s in shards) == n
    assert set().union(*seen) == {p.uid for p in source}
    for i in range(count):
        for j in range(i + 1, count):
            assert not seen[i] & seen[j]


def test_state_round_trip_continues_exactly():
    source = _problems(40)
    reference = _uids(PromptStream(source, seed=11, shard_index=1, shard_count=2), 70)
    first = PromptStream(source, seed=11, shard_index=1, shard_count=2)
    head = _uids(first, 27)  # stop mid-way through the second epoch
    state = json.loads(json.dumps(first.get_state()))  # checkpoints store it as JSON
    resumed = PromptStream(source, seed=11, shard_index=1, shard_count=2)
    resumed.set_state(state)
    assert resumed.position == 27 and resumed.epoch == 1
    tail = _uids(resumed, 43)
    assert head + tail == reference
    # Over each epoch of the resumed run every problem of the shard appears exactly once.
    for e in range(3):
        epoch = (head + tail)[e * 20 : (e + 1) * 20]
        assert len(epoch) == len(set(epoch)) == 20


def test_state_from_different_data_is_refused():
    state = PromptStream(_problems(40), seed=1).get_state()
    for other in (
        PromptStream(_problems(41), seed=1),
        PromptStream(_problems(40), seed=2),
        PromptStream(_problems(40, source="other"), seed=1),
        PromptStream(_problems(40), seed=1, shard_count=2),
    ):
        with pytest.raises(ConfigError, match="state was saved for different data"):
            other.set_state(state)


def test_bad_stream_arguments():
    with pytest.raises(ConfigError, match="shard 2 of 2"):
        PromptStream(_problems(4), shard_index=2, shard_count=2)
    with pytest.raises(ConfigError, match="is empty"):
        PromptStream(_problems(2), shard_index=2, shard_count=3)
    with pytest.raises(ConfigError, match="num_epochs=0"):
        PromptStream(_problems(2), num_epochs=0)
    with pytest.raises(ConfigError, match="seed -1"):
        PromptStream(_problems(2), seed=-1)


def test_two_datasets_of_one_name_are_refused(tmp_path):
    """Uids are name/index: two datasets named alike (two files of one stem, or one file
    twice) would give different problems one uid."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder, question in (("a", "1+1?"), ("b", "2+2?")):
        _write_jsonl(tmp_path / folder / "train.jsonl", [{"question": question, "answer": "2"}])
    specs = [DatasetSpec(path=str(tmp_path / f / "train.jsonl")) for f in ("a", "b")]
    with pytest.raises(ConfigError, match="two datasets are named 'train'") as e:
        load_problems(specs, "data.datasets")
    assert "config.data.datasets:" in str(e.value) and "\n" not in str(e.value)
    named = [specs[0], DatasetSpec(path=specs[1].path, name="train_b")]
    uids = [p.uid for p in load_problems(named, "data.datasets")]
    assert len(set(uids)) == 2
