"""The MovieLens builder (dense ids, time and random splits), the RecBole helper and the example."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import jaxcache.datasets as jd

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "movielens.py"


def ratings(seed=0, users=(3, 8, 40, 41), per_user=12):
    """``(user, item, rating, timestamp)`` rows with sparse original ids and timestamp ties."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in users:
        items = rng.choice([5, 7, 11, 100, 250, 251, 999, 1000, 1001, 1500, 1682, 3, 4], per_user)
        times = rng.integers(1000, 1010, per_user)  # plenty of ties
        rows += [
            (user, int(i), int(rng.integers(1, 6)), int(t))
            for i, t in zip(items, times, strict=True)
        ]
    return rows


def write_zip(directory, rows, *, name="ml-100k.zip", member="ml-100k/u.data", sep="\t"):
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as z:
        z.writestr(member, "".join(sep.join(map(str, row)) + "\n" for row in rows))
    return directory / name


def expected_split(rows, fraction=0.1):
    """Per user, the latest floor(fraction * n) ratings (by time, then item) are the test split."""
    users = sorted({r[0] for r in rows})
    items = sorted({r[1] for r in rows})
    train, test = [], []
    for user in users:
        mine = sorted((r for r in rows if r[0] == user), key=lambda r: (r[3], r[1]))
        held = int(np.floor(fraction * len(mine)))
        train += mine[: len(mine) - held]
        test += mine[len(mine) - held :]

    def dense(part):
        part = sorted(part, key=lambda r: (r[3], r[1]))  # stored in time order
        return [(users.index(u), items.index(i), float(r), t) for u, i, r, t in part]

    return dense(train), dense(test), users, items


def read(builder, split):
    source = builder.as_data_source(split)
    rows = []
    for index in range(len(source)):
        record = source[index]
        rows += zip(
            record["user"].tolist(),
            record["item"].tolist(),
            record["rating"].tolist(),
            record["timestamp"].tolist(),
            strict=True,
        )
    return rows


def build(tmp_path, config="100k"):
    builder = jd.MovieLensBuilder(config=config, data_dir=tmp_path / "data")
    return jd.prepare(builder, tmp_path / "manual")


def test_ids_are_dense_and_the_split_is_by_time_per_user(tmp_path):
    rows = ratings()
    write_zip(tmp_path / "manual", rows)
    builder = build(tmp_path)
    train, test, users, items = expected_split(rows)
    assert read(builder, "train") == train and read(builder, "test") == test
    metadata = builder.info.metadata
    assert metadata["user_ids"] == users and metadata["item_ids"] == items
    assert metadata["cardinalities"] == {"user": [len(users)], "item": [len(items)]}
    assert metadata["rows"] == {"train": len(train), "test": len(test)}
    batch = next(
        iter(jd.Loader(builder.as_data_source("train"), 8, keys=("user", "item", "rating")))
    )
    assert sorted(batch) == ["item", "rating", "user"] and batch["rating"].dtype == np.float32


def test_ml_1m_layout_and_extracted_files(tmp_path):
    rows = ratings(seed=1)
    write_zip(tmp_path / "manual", rows, name="ml-1m.zip", member="ml-1m/ratings.dat", sep="::")
    train, test, *_ = expected_split(rows)
    builder = build(tmp_path, "1m")
    assert read(builder, "train") == train and read(builder, "test") == test
    extracted = tmp_path / "extracted"
    (extracted / "manual" / "ml-100k").mkdir(parents=True)
    (extracted / "manual" / "ml-100k" / "u.data").write_text(
        "".join("\t".join(map(str, r)) + "\n" for r in rows)
    )
    assert read(build(extracted), "test") == test


def original(builder, split):
    """The rows of ``split`` with the original user and item ids."""
    users, items = builder.info.metadata["user_ids"], builder.info.metadata["item_ids"]
    return [(users[u], items[i], int(r), t) for u, i, r, t in read(builder, split)]


def test_random_split_holds_out_a_seeded_sample_of_all_ratings(tmp_path):
    archive = jd.write_fake_movielens(tmp_path / "manual", num_users=60, ratings_per_user=17)
    lines = zipfile.ZipFile(archive).read("ml-100k/u.data").decode().splitlines()
    everything = sorted(tuple(map(int, line.split("\t"))) for line in lines)
    builder = build(tmp_path, "100k_random")
    train, test = original(builder, "train"), original(builder, "test")
    assert len(test) == int(np.floor(0.1 * len(everything))) == 102
    assert not set(train) & set(test) and sorted(train + test) == everything
    for split in (train, test):  # each stored in time order
        assert [r[3] for r in split] == sorted(r[3] for r in split)
    metadata = builder.info.metadata
    assert (metadata["split"], metadata["split_seed"]) == ("random", 0)
    assert metadata["rows"] == {"train": len(train), "test": len(test)}
    # Not the time split: some users have no test rating, others several.
    per_user = np.bincount([r[0] for r in test], minlength=61)[1:]
    assert per_user.min() == 0 and per_user.max() > 1
    # The same seed draws the same sample; another seed, another one.
    again = jd.prepare(
        jd.MovieLensBuilder(config="100k_random", data_dir=tmp_path / "again"), archive.parent
    )
    assert original(again, "test") == test
    other = jd.MovieLensConfig(name="100k_random_seed1", split="random", split_seed=1)
    other = jd.prepare(
        jd.MovieLensBuilder(config=other, data_dir=tmp_path / "data"), archive.parent
    )
    assert len(original(other, "test")) == len(test) and original(other, "test") != test


def test_time_split_is_the_default_and_builds_apart_from_the_random_one(tmp_path):
    rows = ratings(seed=5)
    write_zip(tmp_path / "manual", rows)
    random_split = build(tmp_path, "100k_random")
    time_split = build(tmp_path)  # same data_dir: its own folder, not the random split's
    train, test, *_ = expected_split(rows)
    assert read(time_split, "train") == train and read(time_split, "test") == test
    assert read(random_split, "test") != test
    assert time_split.data_dir != random_split.data_dir
    assert (time_split.info.metadata["split"], random_split.info.metadata["split"]) == (
        "time",
        "random",
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"split": "shuffled"},
            r"split='shuffled' is not a MovieLens split; use 'time' .* 'random'",
        ),
        ({"split": "random", "split_seed": 0.5}, r"split_seed=0\.5 must be an int"),
        ({"split": "random", "test_fraction": 1.0}, r"test_fraction=1\.0 must be in \[0, 1\)"),
    ],
)
def test_bad_split_values_are_refused_with_the_config(values, message):
    with pytest.raises(ValueError, match=message):
        jd.MovieLensConfig(name="mine", **values)


def test_frequencies_per_table(tmp_path):
    rows = ratings(seed=2)
    write_zip(tmp_path / "manual", rows)
    builder = build(tmp_path)
    train = read(builder, "train")
    for key, column in (("user", 0), ("item", 1)):
        counts = jd.count_frequencies(builder, "train", key=key)
        size = builder.info.metadata["cardinalities"][key][0]
        np.testing.assert_array_equal(
            counts, np.bincount([r[column] for r in train], minlength=size)
        )
    with pytest.raises(
        KeyError, match=r"no id field 'sparse'; its id fields are \['item', 'user'\]"
    ):
        jd.count_frequencies(builder, "train")


def test_missing_archive_names_it_and_the_directory(tmp_path):
    (tmp_path / "manual").mkdir()
    (tmp_path / "manual" / "README").write_text("no data here")
    with pytest.raises(FileNotFoundError) as info:
        build(tmp_path)
    message = str(info.value)
    assert "'ml-100k.zip'" in message and "'ml-100k/u.data'" in message
    assert str(tmp_path / "manual") in message
    with pytest.raises(FileNotFoundError, match=r"'ml-1m\.zip'"):
        jd.prepare(jd.MovieLensBuilder(config="1m", data_dir=tmp_path), tmp_path / "nowhere")


def test_archive_without_ratings_and_malformed_lines(tmp_path):
    write_zip(tmp_path / "manual", [(1, 2, 3, 4)], member="ml-100k/u.item")
    with pytest.raises(FileNotFoundError, match=r"holds no 'ml-100k/u\.data'"):
        build(tmp_path)
    rows = [*ratings(seed=3)[:5], ("7", "x9", 3, 100)]
    write_zip(tmp_path / "manual", rows)
    with pytest.raises(jd.DataFormatError, match=r"u\.data, line 6: column 2 \(item\) must be"):
        build(tmp_path)
    write_zip(tmp_path / "manual", [])
    with pytest.raises(jd.DataFormatError, match="the ratings file is empty"):
        build(tmp_path)


def test_recbole_wheel_becomes_a_grouplens_archive(tmp_path):
    rows = ratings(seed=4)
    wheel = tmp_path / "recbole-1.2.1-py3-none-any.whl"
    header = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    body = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("recbole/__init__.py", "")
        z.writestr("recbole/dataset_example/ml-100k/ml-100k.inter", header + body)
    archive = jd.movielens_from_recbole(wheel, tmp_path / "manual")
    assert archive == tmp_path / "manual" / "ml-100k.zip"
    assert zipfile.ZipFile(archive).read("ml-100k/u.data").decode() == body
    _, test, *_ = expected_split(rows)
    assert read(build(tmp_path), "test") == test


def test_recbole_helper_refuses_other_files(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/__init__.py", "")
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps recbole==1\.2\.1"):
        jd.movielens_from_recbole(wheel, tmp_path)
    (tmp_path / "text.whl").write_text("not a zip")
    with pytest.raises(ValueError, match="is not a wheel"):
        jd.movielens_from_recbole(tmp_path / "text.whl", tmp_path)


def test_example_trains_through_the_cache_exactly(tmp_path):
    jd.write_fake_movielens(tmp_path / "manual", num_users=200, num_items=300)
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            *("--manual-dir", str(tmp_path / "manual"), "--data-dir", str(tmp_path / "data")),
            *("--steps", "60", "--batch-size", "8", "--lookahead", "1", "--features", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(result["rmse_cached"] - result["rmse_full"]) <= 1e-5
    assert result["max_table_difference"] <= 1e-5 and result["steps"] == 60
    assert result["user_cache_rows"] == 20 and result["item_cache_rows"] == 30
    assert 0 < result["user_hit_rate"] < 1 and 0 < result["item_hit_rate"] < 1
    assert result["num_users"] == 200 and result["test_ratings"] == 200 * 2


def test_example_refuses_bad_flags_and_missing_data(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("movielens_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit):
        example.parse_args(["--manual-dir", str(tmp_path), "--epochs", "0"])
    assert "--epochs must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse_args(["--manual-dir", str(tmp_path), "--split", "shuffled"])
    assert "argument --split: invalid choice: 'shuffled'" in capsys.readouterr().err
    for split, config in (("time", "1m"), ("random", "1m_random")):
        args = example.parse_args(
            ["--manual-dir", str(tmp_path), "--config", "1m", "--split", split]
        )
        assert example.builder_config(args) == config
    with pytest.raises(SystemExit, match=r"error: .*'ml-100k\.zip'"):
        example.main(["--manual-dir", str(tmp_path), "--data-dir", str(tmp_path)])


def test_example_refuses_a_batch_larger_than_the_training_split(tmp_path):
    spec = importlib.util.spec_from_file_location("movielens_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    jd.write_fake_movielens(tmp_path / "manual", num_users=20, num_items=30)
    flags = ["--manual-dir", str(tmp_path / "manual"), "--data-dir", str(tmp_path / "data")]
    with pytest.raises(SystemExit, match=r"--batch-size=5000 is more than the \d+ training"):
        example.main([*flags, "--batch-size", "5000"])
