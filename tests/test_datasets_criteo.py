"""The Criteo builder against a plain-Python re-parse, its errors, frequencies and DLRM on it."""

import gzip
import math

import numpy as np
import optax
import pytest
from flax import nnx

import jaxcache
import jaxcache.datasets as jd

ROWS = 3000
VOCAB = (2, 3, 1000, *([977] * 23))  # a small shared table
CONFIG = jd.CriteoConfig(name="test", vocab_sizes=VOCAB, skip_malformed=True, rows_per_record=256)
BAD_LINE = 1234  # 1-based line number of the malformed line
HIGH_HASHES = ("ffffffff", "fffffffe", "80000000", "7fffffff")


def reference(lines, vocab):
    """Parses Criteo lines one field at a time, skipping those without 40 fields."""
    labels, counts, ids = [], [], []
    for line in lines:
        fields = line.split("\t")
        if len(fields) != 40:
            continue
        labels.append(float(fields[0]))
        counts.append([max(int(x), 0) if x else 0 for x in fields[1:14]])
        hashes = zip(fields[14:], vocab, strict=True)
        ids.append([1 + int(h, 16) % (v - 1) if h else 0 for h, v in hashes])
    return {
        "dense": np.log1p(np.array(counts, np.float32)),
        "sparse": np.array(ids, np.int64),
        "label": np.array(labels, np.float32),
    }


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    path = jd.write_fake_criteo(tmp_path_factory.mktemp("fake") / "train.txt", ROWS, seed=1)
    lines = path.read_text().splitlines()
    for k, h in enumerate(HIGH_HASHES):  # hashes near 2**32 in every feature
        fields = lines[10 + k].split("\t")
        lines[10 + k] = "\t".join(fields[:14] + [h] * 26)
    lines[BAD_LINE - 1] = "\t".join(lines[BAD_LINE - 1].split("\t")[:39])  # a column short
    return lines


@pytest.fixture(scope="module")
def built(tmp_path_factory, lines):
    manual = tmp_path_factory.mktemp("manual")
    write_lines(manual / "train.txt", lines)
    builder = jd.CriteoBuilder(config=CONFIG, data_dir=tmp_path_factory.mktemp("data"))
    return jd.prepare(builder, manual)


def read_all(builder, split="train"):
    loader = jd.Loader(builder.as_data_source(split), 1000, drop_remainder=False)
    batches = list(loader)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_build_reads_back_equal_to_a_reparse(built, lines):
    got, want = read_all(built), reference(lines, VOCAB)
    assert got["sparse"].dtype == np.int64 and got["dense"].dtype == np.float32
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert len(built.as_data_source("train")) == math.ceil((ROWS - 1) / 256)


def test_malformed_line_is_skipped_and_reported(built):
    metadata = built.info.metadata
    assert metadata["rows"] == {"train": ROWS - 1}
    assert metadata["skipped"] == {"train": 1}
    (example,) = metadata["skipped_examples"]["train"]
    assert f"line {BAD_LINE}: expected 40 fields separated by tabs, found 39" in example
    assert metadata["cardinalities"] == {"sparse": list(VOCAB)}


def test_hashes_near_2_pow_32_reduce_without_int32_wrap(built, tmp_path, lines):
    sparse = read_all(built)["sparse"]
    for k, h in enumerate(HIGH_HASHES):
        assert sparse[10 + k].tolist() == [1 + int(h, 16) % (v - 1) for v in VOCAB]
    # A vocabulary above 2**32 keeps all 32 bits of the hash: 1 + 0xffffffff.
    big = (2**33, *VOCAB[1:])
    write_lines(tmp_path / "manual" / "train.txt", lines[10 : 10 + len(HIGH_HASHES)])
    config = jd.CriteoConfig(name="big", vocab_sizes=big)
    builder = jd.prepare(
        jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), tmp_path / "manual"
    )
    ids = builder.as_data_source("train")[0]["sparse"]
    assert ids.dtype == np.int64 and ids[0, 0] == 2**32 and ids[1, 0] == 2**32 - 1
    shared = jd.to_shared_table(ids, big)
    assert shared[0, 1] == 2**33 + ids[0, 1] and shared.dtype == np.int64


def test_raw_ids_keep_every_hash_apart_by_feature(built, tmp_path, lines):
    # The same lines as the reduced build, each feature's 32-bit hash kept.
    manual = write_lines(tmp_path / "manual" / "train.txt", lines).parent
    config = jd.CriteoConfig(name="test_raw", raw_ids=True, skip_malformed=True)
    builder = jd.prepare(jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), manual)
    raw, reduced = read_all(builder), read_all(built)
    np.testing.assert_array_equal(raw["label"], reduced["label"])
    features = np.arange(26) << 33
    good = [line.split("\t") for line in lines if len(line.split("\t")) == 40]
    want = [
        [int(f) + (int(h, 16) if h else 1 << 32) for f, h in zip(features, row[14:], strict=True)]
        for row in good
    ]
    np.testing.assert_array_equal(raw["sparse"], np.array(want, np.int64))
    assert raw["sparse"][10 + HIGH_HASHES.index("ffffffff"), 0] == 0xFFFFFFFF
    assert builder.info.metadata["raw_ids"] and builder.info.metadata["cardinalities"] == {
        "sparse": None
    }
    assert jd.raw_id(3, 5).item() == 3 * 2**33 + 5
    with pytest.raises(ValueError, match="raw ids have not; read a raw-id dataset"):
        jd.criteo_batches(builder=builder, frequencies=False)
    with pytest.raises(ValueError, match="raw ids have not"):
        jd.criteo_batches(manual, tmp_path / "other", config="kaggle_raw")


def test_gzipped_day_files_give_one_split_each(tmp_path, lines):
    good = [line for line in lines if len(line.split("\t")) == 40]
    write_lines(tmp_path / "manual" / "day_0.gz", good[:700])
    write_lines(tmp_path / "manual" / "day_1", good[700:1000])
    config = jd.CriteoConfig(name="days", vocab_sizes=VOCAB, rows_per_record=256)
    builder = jd.prepare(
        jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), tmp_path / "manual"
    )
    assert builder.info.metadata["rows"] == {"day_0": 700, "day_1": 300}
    np.testing.assert_array_equal(
        read_all(builder, "day_0+day_1")["sparse"], reference(good[:1000], VOCAB)["sparse"]
    )


def test_frequencies_equal_bincount_and_are_reused(built, lines, monkeypatch):
    want = reference(lines, VOCAB)["sparse"] + jd.shared_offsets(VOCAB)
    counts = jd.count_frequencies(built, "train")
    np.testing.assert_array_equal(counts, np.bincount(want.ravel(), minlength=sum(VOCAB)))
    assert jd.frequencies_path(built, "train").exists()

    def no_reading(*args, **kwargs):
        raise AssertionError("the saved counts should have been loaded")

    monkeypatch.setattr(built, "as_data_source", no_reading)
    np.testing.assert_array_equal(jd.count_frequencies(built, "train"), counts)


def test_sampled_frequencies_count_about_that_fraction(built):
    counts = jd.count_frequencies(built, "train", sample_rate=0.5, seed=3)
    assert 0.4 < counts.sum() / ((ROWS - 1) * 26) < 0.6
    assert jd.frequencies_path(built, "train", sample_rate=0.5, seed=3).exists()


def test_dlrm_trains_on_criteo_batches(built):
    data = jd.criteo_batches(builder=built, batch_size=128, seed=0)
    assert data.num_embeddings == sum(VOCAB) and data.offsets.tolist()[:3] == [0, 2, 5]
    config = jaxcache.CacheConfig(
        num_embeddings=data.num_embeddings,
        features=4,
        capacity=0.5,
        policy="frequency",
        optimizer=jaxcache.rowwise_adagrad(0.05),
    )
    cache = jaxcache.EmbeddingCache(config, frequencies=data.frequencies)
    embed = jaxcache.nnx.CachedEmbed(cache)
    model = jaxcache.models.DLRM(
        embed, num_sparse=26, features=4, bottom=(8,), top=(8,), rngs=nnx.Rngs(0)
    )
    _, step = jaxcache.models.make_train_step(model, optax.adagrad(0.05))
    losses = []
    for batch in list(data.batches)[:4]:
        assert batch["sparse"].shape == (128, 26) and batch["dense"].shape == (128, 13)
        lookup = embed.prepare(batch["sparse"])
        losses.append(float(step(batch["dense"], lookup, batch["label"])))
    assert all(np.isfinite(losses)) and cache.stats.steps == 4


def test_the_kaggle_vocabulary_is_the_default(tmp_path, lines):
    write_lines(tmp_path / "manual" / "train.txt.gz", lines[:50])
    data = jd.criteo_batches(
        tmp_path / "manual", tmp_path / "data", batch_size=16, shuffle=False, frequencies=False
    )
    assert data.cardinalities == jaxcache.synthetic.CRITEO_KAGGLE_CARDINALITIES
    assert data.num_embeddings == 33_762_577 and data.frequencies is None
    first = next(data.batches)["sparse"]
    want = reference(lines[:16], jaxcache.synthetic.CRITEO_KAGGLE_CARDINALITIES)["sparse"]
    np.testing.assert_array_equal(first, want + data.offsets)


# ------------------------------------------------------------------ bad input
def build_strict(tmp_path, lines, name="train.txt"):
    if lines is not None:
        write_lines(tmp_path / "manual" / name, lines)
    config = jd.CriteoConfig(name="strict", vocab_sizes=VOCAB)
    return jd.prepare(
        jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), tmp_path / "manual"
    )


def replace_field(line, column, value):
    fields = line.split("\t")
    fields[column] = value
    return "\t".join(fields)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        (0, "2", "column 1 (label) must be 0 or 1, got '2'"),
        (5, "1.5", "column 6 (I5) must be an integer or empty, got '1.5'"),
        (20, "zz12", "column 21 (C7) must be a hexadecimal id of at most 16 digits, or empty"),
        (39, "1" * 17, "column 40 (C26) must be a hexadecimal id"),
    ],
)
def test_malformed_field_names_file_line_and_problem(tmp_path, lines, column, value, message):
    good = [line for line in lines[:40] if len(line.split("\t")) == 40]
    good[6] = replace_field(good[6], column, value)
    with pytest.raises(jd.DataFormatError, match="skip_malformed=True") as info:
        build_strict(tmp_path, good)
    error = info.value
    assert error.line == 7 and error.path.endswith("train.txt")
    assert message in str(error) and f"train.txt, line 7: {message}" in str(error)


@pytest.mark.parametrize("value", ["200000005", "100000000", "ffffffffffffffff"])
def test_raw_ids_refuse_a_hash_that_would_take_another_features_id(tmp_path, lines, value):
    # 0x200000005 in C1 would be C2's id 5; 0x100000000 C1's empty field.
    good = [line for line in lines[:40] if len(line.split("\t")) == 40]
    good[6] = replace_field(good[6], 14, value)
    write_lines(tmp_path / "manual" / "train.txt", good)
    config = jd.CriteoConfig(name="strict_raw", raw_ids=True)
    with pytest.raises(jd.DataFormatError, match=r"line 7: column 15 \(C1\) must be a 32-bit"):
        jd.prepare(jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), tmp_path / "manual")
    # Leading zeros are the same hash: "000000005" is C1's 5.
    good[6] = replace_field(good[6], 14, "000000005")
    write_lines(tmp_path / "manual" / "train.txt", good)
    config = jd.CriteoConfig(name="padded_raw", raw_ids=True)
    builder = jd.prepare(
        jd.CriteoBuilder(config=config, data_dir=tmp_path / "data"), tmp_path / "manual"
    )
    assert 5 in read_all(builder)["sparse"][:, 0].tolist()


def test_wrong_column_count_is_refused_without_skip(tmp_path, lines):
    good = [line for line in lines[:40] if len(line.split("\t")) == 40]
    good[2] += "\textra"
    with pytest.raises(jd.DataFormatError, match=r"line 3: expected 40 fields .* found 41"):
        build_strict(tmp_path, good)
    assert not (tmp_path / "data" / "criteo" / "strict").exists() or not any(
        (tmp_path / "data" / "criteo" / "strict").rglob("*.array_record*")
    )


@pytest.mark.parametrize("name", ["train.txt", "day_3.gz"])
def test_empty_file_is_refused(tmp_path, name):
    (tmp_path / "manual").mkdir()
    (tmp_path / "manual" / name).write_bytes(gzip.compress(b"") if name.endswith(".gz") else b"")
    with pytest.raises(jd.DataFormatError, match=f"{name}: the file is empty"):
        build_strict(tmp_path, None)


def test_a_file_of_malformed_lines_only_is_refused_even_when_skipping(tmp_path):
    write_lines(tmp_path / "manual" / "train.txt", ["1\t2\t3", "garbage"])
    config = jd.CriteoConfig(name="lenient", vocab_sizes=VOCAB, skip_malformed=True)
    builder = jd.CriteoBuilder(config=config, data_dir=tmp_path / "data")
    with pytest.raises(jd.DataFormatError, match=r"no well-formed line \(2 malformed lines"):
        jd.prepare(builder, tmp_path / "manual")


def test_missing_files_name_what_to_put_where(tmp_path):
    (tmp_path / "manual").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        build_strict(tmp_path, None)  # the directory is empty
    assert "'train.txt'" in str(info.value) and str(tmp_path / "manual") in str(info.value)
    (tmp_path / "manual" / "notes.txt").write_text("not Criteo")
    with pytest.raises(FileNotFoundError, match=r"'day_0' \.\.\. 'day_23'"):
        build_strict(tmp_path, None)


def test_vocabulary_too_small_is_refused():
    with pytest.raises(ValueError, match=r"vocab_sizes\[3\]=1 is too small"):
        jd.CriteoConfig(name="bad", vocab_sizes=(2, 2, 2, 1, *([2] * 22)))
    with pytest.raises(ValueError, match="has 3 entries; Criteo has 26"):
        jd.CriteoConfig(name="bad", vocab_sizes=(2, 2, 2))
    with pytest.raises(
        ValueError, match="feature 1 has id 5 at sample 0, but its vocabulary has 5"
    ):
        jd.to_shared_table(np.array([[0, 5]]), [3, 5])


def test_only_array_record_is_written(tmp_path):
    with pytest.raises(ValueError, match="'array_record'"):
        jd.CriteoBuilder(data_dir=tmp_path, file_format="tfrecord")
