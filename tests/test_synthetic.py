"""The synthetic Criteo-like stream: determinism, layout, skew and learnable labels."""

import numpy as np
import pytest

import jaxcache

SCALE = 0.002


@pytest.mark.parametrize("multi_hot", [False, True])
def test_same_seed_same_batches_other_seed_differs(multi_hot):
    make = lambda seed: jaxcache.synthetic.SyntheticCriteo(  # noqa: E731
        scale=SCALE, batch_size=64, seed=seed, multi_hot=multi_hot
    )
    a, b, c = make(0).batch(5), make(0).batch(5), make(1).batch(5)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["sparse"], c["sparse"])
    assert not np.array_equal(a["sparse"], make(0).batch(6)["sparse"])
    held_out = make(0).batch(5, held_out=True)
    assert not np.array_equal(a["sparse"], held_out["sparse"])


def test_shapes_and_dtypes():
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=32)
    batch = data.batch(0)
    assert batch["dense"].dtype == np.float32 and batch["dense"].shape == (32, 13)
    assert batch["sparse"].dtype == np.int64 and batch["sparse"].shape == (32, 26)
    assert batch["label"].dtype == np.float32 and batch["label"].shape == (32,)
    assert set(np.unique(batch["label"])) <= {0.0, 1.0}
    assert np.isfinite(batch["dense"]).all() and (batch["dense"] >= 0).all()


def test_cardinalities_follow_criteo():
    full = jaxcache.synthetic.SyntheticCriteo(scale=1.0)
    assert full.cardinalities == jaxcache.synthetic.CRITEO_KAGGLE_CARDINALITIES
    assert full.num_embeddings == 33_762_577
    small = jaxcache.synthetic.SyntheticCriteo(scale=1e-6)
    assert min(small.cardinalities) >= 3
    assert small.feature_offsets[0] == 0
    np.testing.assert_array_equal(np.diff(small.feature_offsets), small.cardinalities[:-1])


@pytest.mark.parametrize("multi_hot", [False, True])
def test_ids_stay_in_their_feature_range(multi_hot):
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=512, multi_hot=multi_hot)
    ids = data.batch(0)["sparse"]
    offsets = data.feature_offsets
    sizes = np.asarray(data.cardinalities)
    if multi_hot:
        real = ids != data.padding_id
        # Each feature's bag holds exactly its (capped) DCNv2 size.
        np.testing.assert_array_equal(real.sum(-1), np.broadcast_to(data.bag_sizes, (512, 26)))
        lo, hi = offsets[:, None], (offsets + sizes)[:, None]
        assert ((ids >= lo) & (ids < hi) | ~real).all()
    else:
        assert ((ids >= offsets) & (ids < offsets + sizes)).all()
    # The largest features are far from exhausted: ids are spread, not a prefix.
    big = int(np.argmax(sizes))
    column = ids[:, big].reshape(-1) - offsets[big]
    column = column[column >= 0]
    assert column.max() > sizes[big] // 2


def test_bag_sizes_are_capped():
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, multi_hot=True, bag_size=4)
    assert data.bag_sizes == tuple(min(s, 4) for s in jaxcache.synthetic.DCNV2_BAG_SIZES)
    assert data.ids_shape == (data.batch_size, 26, 4)


def test_hottest_one_percent_of_ids_take_a_large_share():
    data = jaxcache.synthetic.SyntheticCriteo(scale=0.01, batch_size=1024)
    counts = data.count_frequencies(10)
    assert counts.sum() == 10 * 1024 * 26
    top = np.sort(counts)[::-1][: data.num_embeddings // 100]
    assert top.sum() / counts.sum() > 0.5
    # Hot ids are scattered over each feature, not the lowest ids of it.
    big = int(np.argmax(data.cardinalities))
    lo = data.feature_offsets[big]
    hottest = lo + np.argsort(-counts[lo : lo + data.cardinalities[big]])[:10]
    assert (hottest - lo).max() > 10


def test_count_frequencies_matches_the_batches():
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=64, multi_hot=True)
    counts = data.count_frequencies(3, start=2)
    expected = np.zeros(data.num_embeddings, np.int64)
    for batch in data.batches(3, start=2):
        ids = batch["sparse"]
        np.add.at(expected, ids[ids >= 0], 1)
    np.testing.assert_array_equal(counts, expected)


def test_labels_are_learnable():
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=4096)
    batch = data.batch(0)
    assert 0.05 < batch["label"].mean() < 0.95
    # The hidden model's own logits rank clicks well: there is signal to learn.
    assert jaxcache.synthetic.roc_auc(batch["label"], data.logits(batch)) > 0.75


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scale"):
        jaxcache.synthetic.SyntheticCriteo(scale=2.0)
    with pytest.raises(ValueError, match="alpha"):
        jaxcache.synthetic.SyntheticCriteo(alpha=1.0)
    with pytest.raises(ValueError, match="padding_id"):
        jaxcache.synthetic.SyntheticCriteo(padding_id=0)
    with pytest.raises(ValueError, match="index"):
        jaxcache.synthetic.SyntheticCriteo(scale=SCALE).batch(-1)


def test_roc_auc_handles_ties_and_single_class():
    y = np.array([0, 1, 0, 1, 1])
    assert jaxcache.synthetic.roc_auc(y, np.zeros(5)) == 0.5
    assert jaxcache.synthetic.roc_auc(y, np.array([0.0, 1, 0, 1, 1])) == 1.0
    assert jaxcache.synthetic.roc_auc(y, -np.array([0.0, 1, 0, 1, 1])) == 0.0
    with pytest.raises(ValueError, match="both classes"):
        jaxcache.synthetic.roc_auc(np.ones(3), np.arange(3.0))
    with pytest.raises(ValueError, match=r"binary .*, got 2 at index 1; threshold them"):
        jaxcache.synthetic.roc_auc(np.array([0, 2, 1]), np.arange(3.0))
