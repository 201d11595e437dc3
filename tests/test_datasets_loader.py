"""The batch loader over row chunks, and the synthetic Criteo builder against its stream."""

import pathlib

import numpy as np
import pytest

import jaxcache
import jaxcache.datasets as jd


def chunks(sizes=(5, 7, 3, 8, 1, 6)):
    """Records of several sizes holding consecutive row numbers."""
    out, start = [], 0
    for size in sizes:
        rows = np.arange(start, start + size)
        out.append({"x": rows, "y": np.stack([rows, -rows], axis=1).astype(np.float32)})
        start += size
    return out


def rows_of(batches):
    return np.concatenate([b["x"] for b in batches]).tolist()


@pytest.mark.parametrize("window", [1, 2, 16])
def test_in_order_batches_are_the_rows_in_storage_order(window):
    batches = list(jd.Loader(chunks(), 4, window=window, drop_remainder=False))
    assert [len(b["x"]) for b in batches] == [4] * 7 + [2]
    assert rows_of(batches) == list(range(30))
    for b in batches:  # fields stay aligned, arrays are writable copies
        np.testing.assert_array_equal(b["y"][:, 0], b["x"])
        assert b["x"].flags.writeable
    assert rows_of(jd.Loader(chunks(), 4, window=window)) == list(range(28))


@pytest.mark.parametrize("window", [1, 3, 16])
def test_shuffled_epochs_are_permutations_fixed_by_the_seed(window):
    loader = jd.Loader(chunks(), 4, shuffle=True, seed=5, window=window, drop_remainder=False)
    first, second = rows_of(loader.epoch(0)), rows_of(loader.epoch(1))
    assert sorted(first) == sorted(second) == list(range(30))
    assert first != list(range(30)) and first != second
    assert rows_of(loader.epoch(0)) == first  # deterministic
    other = jd.Loader(chunks(), 4, shuffle=True, seed=6, window=window, drop_remainder=False)
    assert rows_of(other.epoch(0)) != first
    for b in loader.epoch(0):
        np.testing.assert_array_equal(b["y"][:, 1], -b["x"])


def test_epochs_and_keys():
    loader = jd.Loader(chunks(), 10, shuffle=True, num_epochs=3, keys=("x",))
    batches = list(loader)
    assert len(batches) == 9 and all(sorted(b) == ["x"] for b in batches)
    assert rows_of(batches[:3]) == rows_of(loader.epoch(0))
    forever = iter(jd.Loader(chunks(), 10, num_epochs=None))
    assert len([next(forever) for _ in range(10)]) == 10


def test_bad_arguments_and_sources():
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        jd.Loader(chunks(), 0)
    with pytest.raises(ValueError, match="the source holds no records"):
        jd.Loader([], 4)
    with pytest.raises(ValueError, match="fewer rows than batch_size=64"):
        list(jd.Loader(chunks(), 64))
    with pytest.raises(KeyError, match=r"no field 'z'; its fields are \['x', 'y'\]"):
        list(jd.Loader(chunks(), 4, keys=("z",)))
    with pytest.raises(ValueError, match="different numbers of rows"):
        list(jd.Loader([{"x": np.arange(3), "y": np.arange(4)}], 2))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    config = jd.SyntheticCriteoConfig(
        name="test", scale=0.001, num_rows=1000, num_test_rows=300, rows_per_record=256
    )
    builder = jd.SyntheticCriteoBuilder(config=config, data_dir=tmp_path_factory.mktemp("data"))
    return jd.prepare(builder)


def test_synthetic_builder_stores_the_stream(synthetic):
    stream = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=256)
    data = jd.criteo_batches(builder=synthetic, batch_size=256, shuffle=False)
    assert data.cardinalities == stream.cardinalities
    assert data.num_embeddings == stream.num_embeddings
    for index, batch in enumerate(data.batches):
        want = stream.batch(index)
        for key in want:
            np.testing.assert_array_equal(batch[key], want[key])
    assert index == 2  # 1000 rows: 3 full batches
    np.testing.assert_array_equal(data.frequencies, stream.count_frequencies(4) - tail(stream))
    held_out = synthetic.as_data_source("test")[0]
    np.testing.assert_array_equal(held_out["label"], stream.batch(0, held_out=True)["label"])
    assert synthetic.info.metadata["rows"] == {"train": 1000, "test": 300}


def tail(stream):
    """Counts of the rows 1000..1023 of the stream, beyond the split."""
    ids = stream.batch(3)["sparse"][1000 - 3 * 256 :]
    return np.bincount(ids.ravel(), minlength=stream.num_embeddings)


def test_multi_hot_synthetic_keeps_padding(tmp_path):
    config = jd.SyntheticCriteoConfig(
        name="bags", scale=0.001, multi_hot=True, bag_size=4, num_rows=64, num_test_rows=8
    )
    builder = jd.prepare(jd.SyntheticCriteoBuilder(config=config, data_dir=tmp_path))
    data = jd.criteo_batches(builder=builder, batch_size=64, shuffle=False)
    want = jaxcache.synthetic.SyntheticCriteo(
        scale=0.001, batch_size=4096, multi_hot=True, bag_size=4
    )
    batch = next(data.batches)
    assert batch["sparse"].shape == (64, 26, 4) and data.padding_id == -1
    np.testing.assert_array_equal(batch["sparse"], want.batch(0)["sparse"][:64])
    counts = data.frequencies
    real = batch["sparse"][batch["sparse"] >= 0]
    np.testing.assert_array_equal(counts, np.bincount(real, minlength=want.num_embeddings))


def test_prepare_reuses_a_built_dataset(synthetic):
    files = sorted(pathlib.Path(synthetic.data_dir).glob("*.array_record*"))
    stamps = [f.stat().st_mtime_ns for f in files]
    again = jd.SyntheticCriteoBuilder(
        config=synthetic.builder_config, data_dir=synthetic.data_dir_root
    )
    jd.prepare(again)
    assert [f.stat().st_mtime_ns for f in files] == stamps and len(files) == 2


def test_a_builder_that_was_not_prepared_says_so(tmp_path):
    builder = jd.SyntheticCriteoBuilder(data_dir=tmp_path)
    with pytest.raises(ValueError, match="build it first with"):
        jd.count_frequencies(builder)
