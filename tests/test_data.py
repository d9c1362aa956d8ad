"""Data package: digits split, safetensors shard format + validation, Megatron global-batch sampler."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits

from dmd2_mega.data import DigitsDataset, GlobalBatchSampler, ShardDataset, build_dataset, load_shards, write_shards
from dmd2_mega.errors import DataError

# ---------------------------------------------------------------- digits


def test_digits_matches_sklearn_scaled():
    ref = load_digits()
    for split, n in (("train", 1438), ("heldout", 359)):
        ds = DigitsDataset(split)
        assert len(ds) == n and ds.x.shape == (n, 1, 8, 8) and ds.x.dtype == torch.float32
        assert ds.cond.dtype == torch.int64 and (ds.channels, ds.image_size) == (1, 8)
        assert ds.num_classes == 10 and ds.cond_shape is None
        # independent reference: 0..16 -> [-1, 1] linearly
        want = torch.tensor(ref.images[ds.indices] / 8.0 - 1.0, dtype=torch.float32).unsqueeze(1)
        torch.testing.assert_close(ds.x, want, rtol=0, atol=0)
        assert torch.equal(ds.cond, torch.tensor(ref.target[ds.indices]))
        assert ds.x.min() == -1.0 and ds.x.max() == 1.0


def test_digits_split_fixed_disjoint_stratified():
    tr, ho = DigitsDataset("train"), DigitsDataset("heldout")
    assert len(set(tr.indices) & set(ho.indices)) == 0
    assert sorted(set(tr.indices) | set(ho.indices)) == list(range(1797))
    assert np.array_equal(DigitsDataset("heldout").indices, ho.indices)  # fixed
    counts_tr, counts_ho = np.bincount(tr.cond.numpy(), minlength=10), np.bincount(ho.cond.numpy(), minlength=10)
    assert (counts_tr > 0).all() and (counts_ho > 0).all()
    frac = counts_ho / (counts_tr + counts_ho)
    assert np.all(np.abs(frac - 0.2) < 0.01), frac
    # the split is not just "first 20 %": held-out indices spread over the whole file
    assert ho.indices.min() < 100 and ho.indices.max() > 1697


def test_digits_batch_and_null_cond():
    ds = DigitsDataset()
    idx = torch.tensor([5, 0, 5, 1437])
    x, y = ds.get_batch(idx)
    assert x.shape == (4, 1, 8, 8) and torch.equal(x[0], x[2]) and torch.equal(y, ds.cond[idx])
    assert torch.equal(ds.null_cond(3), torch.full((3,), 10, dtype=torch.int64))
    with pytest.raises(DataError, match="split"):
        DigitsDataset("test")


# ---------------------------------------------------------------- shards


def _labelled(n=7, c=2, h=4, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, h, generator=g), torch.randint(0, k, (n,), generator=g)


def test_shards_roundtrip_labels(tmp_path):
    lat, lab = _labelled()
    index = write_shards(str(tmp_path), lat, labels=lab, num_classes=5, shard_size=3)
    assert [s["num_samples"] for s in index["shards"]] == [3, 3, 1]
    ds = build_dataset(str(tmp_path))
    assert isinstance(ds, ShardDataset) and len(ds) == 7
    assert (ds.channels, ds.image_size, ds.num_classes, ds.cond_shape) == (2, 4, 5, None)
    x, y = ds.get_batch(torch.tensor([6, 0, 3]))
    assert torch.equal(x, lat[[6, 0, 3]]) and torch.equal(y, lab[[6, 0, 3]]) and y.dtype == torch.int64
    assert torch.equal(ds.null_cond(2), torch.tensor([5, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shards_roundtrip_embedding(tmp_path, dtype):
    lat = torch.randn(5, 3, 2, 2).to(dtype)
    emb = torch.randn(5, 4, 6).to(dtype)
    write_shards(str(tmp_path), lat, cond=emb, shard_size=2)
    ds = ShardDataset(str(tmp_path))
    assert (ds.num_classes, ds.cond_shape, ds.channels, ds.image_size) == (None, (4, 6), 3, 2)
    x, c = ds.get_batch(torch.arange(5))
    assert x.dtype == c.dtype == dtype  # streamed in the stored dtype; the loader casts on the device
    assert torch.equal(x, lat) and torch.equal(c, emb)
    assert torch.equal(ds.null_cond(3), torch.zeros(3, 4, 6))
    mem = load_shards(str(tmp_path))  # the in-memory reader: float32
    assert mem.x.dtype == mem.cond.dtype == torch.float32 and torch.equal(mem.x, lat.float())


def _corrupt(path, **tensors):
    """Overwrite shard_00001 of a 3-shard label set (3, 3, 1 samples) with the given tensors."""
    lat, lab = _labelled()
    write_shards(str(path), lat, labels=lab, num_classes=5, shard_size=3)
    good = {"latents": lat[3:6].clone(), "labels": lab[3:6].clone()}
    good.update(tensors)
    save_file(good, os.path.join(path, "shard_00001.safetensors"))


BAD = "shard_00001.safetensors"


NAN_ONE = torch.zeros(3, 2, 4, 4).index_put_((torch.tensor([1]), torch.tensor([0]), torch.tensor([2]),
                                                torch.tensor([3])), torch.tensor(float("nan")))


@pytest.mark.parametrize("case, tensors, when, expect", [
    ("latent shape", {"latents": torch.randn(3, 2, 4, 5)}, "open", "[3, 2, 4, 4]"),
    ("sample count", {"latents": torch.randn(2, 2, 4, 4)}, "open", "[3, 2, 4, 4]"),
    ("int latents", {"latents": torch.zeros(3, 2, 4, 4, dtype=torch.int32)}, "open", "floating"),
    ("float labels", {"labels": torch.tensor([0.0, 1.0, 2.0])}, "open", "integer"),
    ("label shape", {"labels": torch.tensor([0, 1])}, "open", "[3]"),
    # values are checked as the rows are read (the start-up check reads headers only)
    ("nan", {"latents": NAN_ONE}, "read", "'latents' has 1 non-finite values (NaN/inf) in sample 1"),
    ("inf", {"latents": torch.full((3, 2, 4, 4), float("inf"))}, "read", "non-finite"),
    ("label range", {"labels": torch.tensor([0, 5, 1])}, "read", "[0, 5)"),
    ("negative label", {"labels": torch.tensor([0, -1, 1])}, "read", "[0, 5)"),
])
def test_malformed_shard_names_file(tmp_path, case, tensors, when, expect):
    _corrupt(tmp_path, **tensors)
    with pytest.raises(DataError) as e:
        ds = ShardDataset(str(tmp_path))
        assert when == "read", f"{case}: opened without the header check failing"
        ds.get_batch(torch.tensor([0, 1, 2]))  # shard 0 is good
        ds.get_batch(torch.tensor([5, 6, 4, 3]))  # shard 1 holds samples 3..5
    assert BAD in str(e.value) and expect in str(e.value), str(e.value)


def test_missing_tensor_and_missing_shard(tmp_path):
    lat, lab = _labelled()
    write_shards(str(tmp_path), lat, labels=lab, shard_size=3)
    save_file({"latents": lat[3:6].contiguous()}, os.path.join(tmp_path, BAD))
    with pytest.raises(DataError, match=f"{BAD}.*'labels'"):
        ShardDataset(str(tmp_path))
    os.remove(os.path.join(tmp_path, BAD))
    with pytest.raises(DataError, match=f"{BAD}.*missing"):
        ShardDataset(str(tmp_path))


def test_corrupt_file_and_embedding_shape(tmp_path):
    lat = torch.randn(4, 1, 2, 2)
    write_shards(str(tmp_path), lat, cond=torch.randn(4, 8), shard_size=2)
    save_file({"latents": lat[2:], "cond": torch.randn(2, 7)}, os.path.join(tmp_path, BAD))
    with pytest.raises(DataError, match=f"{BAD}.*'cond' expected shape \\[2, 8\\]"):
        ShardDataset(str(tmp_path))
    with open(os.path.join(tmp_path, BAD), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(DataError, match=f"{BAD}.*cannot read"):
        ShardDataset(str(tmp_path))


def test_directory_and_index_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="empty data directory.*index.json"):
        ShardDataset(str(empty))
    lat, lab = _labelled()
    d = tmp_path / "noindex"
    write_shards(str(d), lat, labels=lab, shard_size=3)
    os.remove(d / "index.json")
    with pytest.raises(DataError, match="index.json: missing"):
        ShardDataset(str(d))
    (d / "index.json").write_text("{not json")
    with pytest.raises(DataError, match="index.json: cannot parse"):
        ShardDataset(str(d))
    for bad in ({"shards": [], "latent_shape": [1, 2, 2], "cond": "labels", "num_classes": 2},
                {"shards": [{"file": BAD, "num_samples": 1}], "latent_shape": [1, 2], "cond": "labels",
                 "num_classes": 2},
                {"shards": [{"file": BAD, "num_samples": 1}], "latent_shape": [1, 2, 2], "cond": "text"}):
        (d / "index.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match="index.json"):
            ShardDataset(str(d))
    # non-square images and video latents [C, T, H, W] are data like any other (a model says what it takes)
    write_shards(str(tmp_path / "rect"), torch.randn(2, 1, 2, 3), labels=torch.tensor([0, 1]))
    assert ShardDataset(str(tmp_path / "rect")).spatial == (2, 3)
    write_shards(str(tmp_path / "video"), torch.randn(2, 4, 3, 2, 6), cond=torch.randn(2, 5, 7))
    assert ShardDataset(str(tmp_path / "video")).spatial == (3, 2, 6)


S0, S1, S2 = (f"shard_0000{i}.safetensors" for i in range(3))


@pytest.mark.parametrize("files, links, needle", [
    ([S0, S1, S0, S2], {}, f"lists the shard {{d}}/{S0} twice (entries 0 {S0!r} and 2 {S0!r})"),
    ([S0, S1, f"./{S0}", S2], {}, f"lists the shard {{d}}/{S0} twice (entries 0 {S0!r} and 2 './{S0}')"),
    ([S0, S1, "alias.safetensors", S2], {"alias.safetensors": S0},
     f"lists the shard {{d}}/{S0} twice (entries 0 {S0!r} and 2 'alias.safetensors')"),
    ([S0, "{other}/" + S1, S2], {}, "entry 1 '{other}/" + S1 + "' is an absolute path"),
    ([S0, "../other/" + S1, S2], {}, "entry 1 '../other/" + S1 + "' resolves to {other}/" + S1 + ", outside the data "
     "directory {d}"),
    ([S0, "link.safetensors", S2], {"link.safetensors": "{other}/" + S1},
     "entry 1 'link.safetensors' resolves to {other}/" + S1 + ", outside the data directory {d}"),
    ([S0, "sub/" + S1, S2], {"sub": "{other}"}, "entry 1 'sub/" + S1 + "' resolves to {other}/" + S1 + ", outside"),
], ids=["twice", "twice-spelt-otherwise", "twice-through-a-symlink", "absolute", "dot-dot", "symlink-out",
        "symlinked-folder-out"])
def test_index_entries_inside_the_directory_and_once(tmp_path, files, links, needle):
    """index.json may list each shard once and only files inside the data directory (after resolving '..' and
    symlinks): a shard listed twice would be read twice as often as the others, an entry outside reads a file the
    set does not hold. Refused at start-up with the index file and the entry; the same shards listed properly
    (also from a symlinked data directory, or a subfolder of it) open."""
    lat, lab = _labelled()
    d, other = tmp_path / "data", tmp_path / "other"
    write_shards(str(d), lat, labels=lab, shard_size=3)
    write_shards(str(other), lat, labels=lab, shard_size=3)
    index = json.loads((d / "index.json").read_text())
    sizes = {e["file"]: e["num_samples"] for e in index["shards"]}
    for name, target in links.items():
        os.symlink(target.format(other=other), d / name)
    index["shards"] = [{"file": f.format(other=other), "num_samples": sizes.get(os.path.basename(f), 3)}
                       for f in files]  # an alias names a 3-sample shard
    (d / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError) as e:
        ShardDataset(str(d))
    assert str(e.value).startswith(f"{d}/index.json: "), str(e.value)
    assert needle.format(d=d, other=other) in str(e.value), str(e.value)
    (d / "part").mkdir()
    os.rename(d / S2, d / "part" / S2)
    index["shards"] = [{"file": f, "num_samples": sizes[os.path.basename(f)]} for f in (S0, S1, "part/" + S2)]
    (d / "index.json").write_text(json.dumps(index))
    os.symlink(d, tmp_path / "data_link")
    assert torch.equal(ShardDataset(str(tmp_path / "data_link")).get_batch(torch.arange(7))[0], lat)


def test_build_dataset_errors(tmp_path):
    assert isinstance(build_dataset("digits", "heldout"), DigitsDataset)
    with pytest.raises(DataError, match="--data"):
        build_dataset(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="--data"):
        build_dataset("mnist")
    lat, lab = _labelled()
    write_shards(str(tmp_path), lat, labels=lab)
    with pytest.raises(DataError, match="heldout"):
        build_dataset(str(tmp_path), split="heldout")


# ---------------------------------------------------------------- sampler


@pytest.mark.parametrize("n, G, m, dp", [(50, 12, 3, 2), (50, 12, 2, 3), (37, 8, 1, 4), (9, 6, 3, 1)])
def test_dp_ranks_partition_the_global_batch(n, G, m, dp):
    ref = GlobalBatchSampler(n, G, m, 0, 1, seed=7)
    ranks = [GlobalBatchSampler(n, G, m, r, dp, seed=7) for r in range(dp)]
    for _ in range(3 * (n // G) + 1):  # crosses epoch boundaries
        want = ref.next_iteration()
        got = [pair for s in ranks for pair in s.next_iteration()]
        # rank r's block follows rank r-1's, so the concatenation is j = 0 .. G/m - 1 in order
        assert [j for j, _ in got] == [j for j, _ in want] == list(range(G // m))
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == torch.int64 and a.shape == (m,) and torch.equal(a, b)
        assert all(s.consumed_samples == ref.consumed_samples for s in ranks)


def test_epochs_are_permutations_dropping_the_tail():
    n, G = 23, 6  # 3 iterations per epoch, 5 samples dropped each epoch
    s = GlobalBatchSampler(n, G, 2, 0, 1, seed=3)
    epochs = []
    for e in range(3):
        idx = torch.cat([torch.cat([b for _, b in s.next_iteration()]) for _ in range(3)])
        assert s.epoch == e + 1 and s.consumed_samples == (e + 1) * 18
        assert len(set(idx.tolist())) == 18 and idx.min() >= 0 and idx.max() < n
        epochs.append(idx)
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    other = GlobalBatchSampler(n, G, 2, 0, 1, seed=4).global_batch()
    assert not torch.equal(other, epochs[0][:G])


def test_state_dict_resumes_exactly():
    a = GlobalBatchSampler(40, 8, 2, 1, 2, seed=11)
    for _ in range(7):
        a.next_iteration()
    state = a.state_dict()
    assert state["consumed_samples"] == 56
    b = GlobalBatchSampler(40, 8, 2, 1, 2, seed=11)
    b.load_state_dict(state)
    for _ in range(9):
        for (ja, ia), (jb, ib) in zip(a.next_iteration(), b.next_iteration()):
            assert ja == jb and torch.equal(ia, ib)
    with pytest.raises(DataError, match="--seed"):
        GlobalBatchSampler(40, 8, 2, 1, 2, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="--global-batch-size"):
        GlobalBatchSampler(40, 16, 2, 1, 2, seed=11).load_state_dict(state)


def test_sampler_validation():
    with pytest.raises(DataError, match="--global-batch-size.*--micro-batch-size"):
        GlobalBatchSampler(100, 10, 3, 0, 1)
    with pytest.raises(DataError, match="--global-batch-size.*--micro-batch-size"):
        GlobalBatchSampler(100, 12, 3, 0, 8)
    with pytest.raises(DataError, match="--global-batch-size.*dataset size"):
        GlobalBatchSampler(10, 12, 3, 0, 1)
    with pytest.raises(DataError, match="--seed"):
        GlobalBatchSampler(100, 12, 3, 0, 1, seed=-1)
    with pytest.raises(DataError, match="dp_rank"):
        GlobalBatchSampler(100, 12, 3, 2, 2)
