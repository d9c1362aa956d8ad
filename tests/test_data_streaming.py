"""The streaming shard reader and its DataLoader: the in-memory reader's samples in the sampler's order, with 0 or
2 workers, an exact mid-epoch resume, bounded host memory on a set several times larger than the test allows
itself, and header-only start-up checks (a truncated shard is caught at open)."""
import json
import os
import shutil
import threading

import psutil
import pytest
import torch
from safetensors.torch import save_file

from dmd2_mega.data import GlobalBatchSampler, ShardDataset, load_shards, write_shards
from dmd2_mega.data.loader import MicroBatchLoader
from dmd2_mega.errors import DataError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def text_set(tmp_path_factory):
    """23 bf16 video latents [2, 3, 4, 6] with bf16 text [5, 8] over uneven shards (7, 7, 7, 2)."""
    g = torch.Generator().manual_seed(0)
    path = str(tmp_path_factory.mktemp("text"))
    write_shards(path, torch.randn(23, 2, 3, 4, 6, generator=g).bfloat16(),
                 cond=torch.randn(23, 5, 8, generator=g).bfloat16(), shard_size=7,
                 negative=torch.randn(5, 8, generator=g).bfloat16())
    return path


def _batches(path, workers, iters, consumed=0, dp_rank=0, dp_size=1):
    ds = ShardDataset(path, max_open=2)
    sampler = GlobalBatchSampler(len(ds), 6, 3, dp_rank, dp_size, seed=4, consumed_samples=consumed)
    loader = MicroBatchLoader(ds, sampler, CPU, num_workers=workers)
    out = [loader.next_iteration() for _ in range(iters)]
    loader.close()
    return out, sampler


def test_streaming_equals_in_memory_in_sampler_order(text_set):
    """Three epochs (3 iterations each, 2 micro-batches of 3): every batch equals the in-memory reader's rows for
    the sampler's indices, cast to float32 only at the device; workers 0 and 2 give identical batches."""
    mem = load_shards(text_set)
    ref = GlobalBatchSampler(len(mem), 6, 3, seed=4)
    runs = {w: _batches(text_set, w, 9)[0] for w in (0, 2)}
    for it in range(9):
        want = ref.next_iteration()
        for w, run in runs.items():
            assert [j for j, _, _ in run[it]] == [j for j, _ in want]
            for (_, x, c), (_, idx) in zip(run[it], want):
                assert x.dtype == c.dtype == torch.float32
                assert torch.equal(x, mem.x[idx]) and torch.equal(c, mem.cond[idx]), (w, it)
    ds = ShardDataset(text_set)
    assert ds.negative.dtype == torch.float32 and torch.equal(ds.negative, mem.negative)
    assert torch.equal(ds.null_cond(2), mem.null_cond(2))


def test_exact_resume_mid_epoch(text_set):
    """A sampler restored from a state saved after 4 iterations (mid-epoch 2) continues with exactly the batches
    of the uninterrupted run; the read-ahead restarts where the sampler is."""
    full, _ = _batches(text_set, 2, 7)
    first, sampler = _batches(text_set, 2, 4)
    state = sampler.state_dict()
    ds = ShardDataset(text_set)
    resumed = GlobalBatchSampler(len(ds), 6, 3, seed=4)
    loader = MicroBatchLoader(ds, resumed, CPU, num_workers=2)
    loader.next_iteration()  # a read-ahead started at 0, then the resume moves the sampler
    resumed.load_state_dict(state)
    rest = [loader.next_iteration() for _ in range(3)]
    loader.close()
    for a, b in zip(full[4:], rest):
        for (ja, xa, ca), (jb, xb, cb) in zip(a, b):
            assert ja == jb and torch.equal(xa, xb) and torch.equal(ca, cb)


def test_data_parallel_ranks_split_the_global_batch(text_set):
    """DP=2: rank r's micro-batch j is the single-rank run's micro-batch j (Megatron's split, read by workers)."""
    one, _ = _batches(text_set, 0, 3)
    ranks = [_batches(text_set, 2, 3, dp_rank=r, dp_size=2)[0] for r in (0, 1)]
    for it in range(3):
        got = {j: x for r in ranks for j, x, _ in r[it]}
        assert sorted(got) == [0, 1]
        for j, x, _ in one[it]:
            assert torch.equal(got[j], x)


def test_conditions_only_skip_the_latents(text_set):
    ds = ShardDataset(text_set)
    mem = load_shards(text_set)
    sampler = GlobalBatchSampler(len(ds), 6, 3, seed=4)
    loader = MicroBatchLoader(ds, sampler, CPU, num_workers=2, latents=False)
    (j, x, c), _ = loader.next_iteration()
    loader.close()
    idx = GlobalBatchSampler(len(ds), 6, 3, seed=4).next_iteration()[0][1]
    assert x is None and torch.equal(c, mem.cond[idx])


def test_truncated_shard_caught_at_open(tmp_path):
    write_shards(str(tmp_path), torch.randn(6, 1, 2, 2), labels=torch.arange(6) % 2, shard_size=3)
    shard = os.path.join(tmp_path, "shard_00001.safetensors")
    os.truncate(shard, os.path.getsize(shard) - 5)
    with pytest.raises(DataError, match=f"{shard}: cannot read as safetensors \\(truncated"):
        ShardDataset(str(tmp_path))


def _change(shard: str, how: str) -> str:
    """Change one shard as another process would during a run; returns what the DataError must say changed."""
    st = os.stat(shard)
    if how == "deleted":
        os.remove(shard)
        return f"deleted ({st.st_size} bytes at start-up)"
    if how == "truncated":
        os.truncate(shard, st.st_size - 40)
        return f"truncated to {st.st_size - 40} bytes (its header needs {st.st_size}; {st.st_size} at start-up)"
    if how == "grown":
        with open(shard, "ab") as f:
            f.write(bytes(16))
        return f"now {st.st_size + 16} bytes, {st.st_size} at start-up"
    if how == "rewritten":  # same size and file, other bytes; the clock may not have ticked, so the mtime is set
        with open(shard, "r+b") as f:
            f.seek(st.st_size - 8)
            f.write(bytes(8))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return "modified (same size; mtime "
    shutil.copy(shard, shard + ".new")  # "replaced": another file renamed over it (a reader holding the old one
    os.replace(shard + ".new", shard)  # open still reads the old bytes)
    return f"replaced by another file (inode {st.st_ino} at start-up, now {os.stat(shard).st_ino})"


@pytest.mark.parametrize("workers,max_open", [(0, 1), (0, 8), (2, 8)], ids=["reopened", "open", "workers"])
@pytest.mark.parametrize("how", ["deleted", "truncated", "grown", "rewritten", "replaced"])
def test_shard_changed_during_the_run(tmp_path, capfd, how, workers, max_open):
    """A shard changed after start-up (while the reader holds it open, or when it reopens it: max_open=1 closes it
    after each batch) stops the read with ONE DataError in the training process, raised from the first batch read
    after the change (with workers: once the batches read ahead before it are used up), naming the shard and what
    changed; a worker prints nothing."""
    write_shards(str(tmp_path), torch.randn(12, 1, 2, 2), labels=torch.arange(12) % 3, shard_size=6)
    shard = os.path.join(tmp_path, "shard_00001.safetensors")
    ds = ShardDataset(str(tmp_path), max_open=max_open)
    sampler = GlobalBatchSampler(len(ds), 12, 12, seed=0)  # every batch reads both shards
    loader = MicroBatchLoader(ds, sampler, CPU, num_workers=workers, prefetch_factor=1)
    loader.next_iteration()
    what = _change(shard, how)
    with pytest.raises(DataError) as e:
        for _ in range(1 + workers):  # the read-ahead's batches (workers x prefetch_factor), then the changed read
            loader.next_iteration()
    loader.close()
    assert str(e.value).startswith(f"{shard}: the shard changed during the run: {what}"), str(e.value)
    assert "resume" in str(e.value)
    assert "Traceback" not in capfd.readouterr().err
    assert not [fd for fd in _fds() if fd.startswith(shard)], "the changed shard was left open"


def _fds() -> list:
    """What this process's open file descriptors point to (Linux)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return out


def test_read_error_names_the_shard(tmp_path, monkeypatch):
    """An I/O error reading an unchanged shard is a DataError naming the shard and the OS error."""
    write_shards(str(tmp_path), torch.randn(6, 1, 2, 2), labels=torch.arange(6) % 2, shard_size=3)
    ds = ShardDataset(str(tmp_path))

    def eio(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(DataError) as e:
        ds.get_batch(torch.tensor([4]))
    shard = os.path.join(tmp_path, "shard_00001.safetensors")
    assert str(e.value) == f"{shard}: cannot read the shard ([Errno 5] Input/output error)", str(e.value)


def _big_set(path: str, shards: int, per_shard: int, shape: tuple) -> int:
    """A labelled fp32 set written one shard at a time (never whole in memory); returns its bytes."""
    g = torch.Generator().manual_seed(1)
    entries = []
    for i in range(shards):
        name = f"shard_{i:05d}.safetensors"
        save_file({"latents": torch.randn(per_shard, *shape, generator=g), "labels": torch.arange(per_shard) % 7},
                  os.path.join(path, name))
        entries.append({"file": name, "num_samples": per_shard})
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump({"shards": entries, "latent_shape": list(shape), "cond": "labels", "num_classes": 7}, f)
    return shards * per_shard * 4 * int(torch.tensor(shape).prod())


class _PeakRSS:
    """Samples this process's resident set size every millisecond on a thread."""

    def __enter__(self):
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.stop.wait(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


@pytest.mark.parametrize("workers", [0, 2])
def test_host_memory_is_bounded_by_the_batch_not_the_set(tmp_path, workers):
    """A 160 MiB set (40 shards of 4 MiB) read end to end, one epoch of 16-sample batches, while this process
    allows itself 24 MiB of RSS growth: streaming holds a few batches (~1 MiB each) and at most two open
    shards' headers; reading the set whole (the in-memory reader) grows by the full 160 MiB, and so does a reader
    that keeps its batches (both measured: 170 and 155-158 MiB)."""
    size = _big_set(str(tmp_path), shards=40, per_shard=64, shape=(4, 4, 32, 32))
    ds = ShardDataset(str(tmp_path), max_open=2)
    sampler = GlobalBatchSampler(len(ds), 16, 16, seed=0)
    loader = MicroBatchLoader(ds, sampler, CPU, num_workers=workers)
    read = sum(x.shape[0] for _, x, _ in loader.next_iteration())  # workers started, first batch: the baseline
    with _PeakRSS() as rss:
        for _ in range(sampler.iters_per_epoch - 1):
            for _, x, y in loader.next_iteration():
                read += x.shape[0]
                x.sum()  # touch the batch as a training step would (a worker's batch arrives in shared memory)
    loader.close()
    assert size == 160 * 2**20 and read == len(ds) == 2560
    assert rss.growth < 24 * 2**20, f"RSS grew {rss.growth / 2**20:.1f} MiB reading a {size / 2**20:.0f} MiB set"
