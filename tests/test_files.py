"""dmd2_mega/files/atomic.py and json_file.py: the one atomic write (by file object and by path), the durable
rename, and the one JSON settings reader with its three one-line errors."""
import os
import stat

import pytest

from dmd2_mega.errors import ConfigError, DataError
from dmd2_mega.files.atomic import atomic_path, atomic_write, durable_replace
from dmd2_mega.files.json_file import read_json


def _left(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_atomic_write_replaces_whole_with_mode_644(tmp_path):
    path = tmp_path / "sub" / "f.txt"  # the parent is created
    atomic_write(str(path), lambda f: f.write("one"), text=True)
    atomic_write(str(path), lambda f: f.write(b"two"))
    assert path.read_bytes() == b"two"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert _left(path.parent) == []


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fail(f=None):
        if f is not None:
            f.write(b"half")
        raise error

    with pytest.raises(type(error)):
        atomic_write(str(path), fail)
    with pytest.raises(type(error)):  # the hook between the fsync and the rename fails: nothing replaced either
        atomic_write(str(path), lambda f: f.write(b"new"), before_replace=fail)
    assert path.read_bytes() == b"old" and _left(tmp_path) == []


def test_atomic_path_for_a_writer_that_needs_a_name(tmp_path):
    path = tmp_path / "clip.mp4"
    with atomic_path(str(path)) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".tmp") and not path.exists()
        with open(tmp, "wb") as f:
            f.write(b"frames")
    assert path.read_bytes() == b"frames" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with pytest.raises(RuntimeError):
        with atomic_path(str(path)) as tmp:
            open(tmp, "wb").write(b"cut")
            raise RuntimeError("ffmpeg died")
    assert path.read_bytes() == b"frames" and _left(tmp_path) == []


def test_durable_replace_moves_a_folder_into_place(tmp_path):
    (tmp_path / "iter.tmp").mkdir()
    (tmp_path / "iter.tmp" / "a").write_text("x")
    durable_replace(str(tmp_path / "iter.tmp"), str(tmp_path / "iter"))
    assert (tmp_path / "iter" / "a").read_text() == "x" and not (tmp_path / "iter.tmp").exists()
    with pytest.raises(OSError):  # a rename that fails leaves the destination as it was
        durable_replace(str(tmp_path / "missing"), str(tmp_path / "iter"))
    assert (tmp_path / "iter" / "a").read_text() == "x"


def test_read_json_object_and_its_errors(tmp_path):
    good = tmp_path / "config.json"
    good.write_text('{"a": 1}')
    assert read_json(str(good)) == {"a": 1}
    cases = {"missing.json": None, "bad.json": "{not json", "latin.json": b"{\"a\": \"\xe9\"}", "list.json": "[1]"}
    for name, text in cases.items():
        if isinstance(text, bytes):
            (tmp_path / name).write_bytes(text)
        elif text is not None:
            (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        read_json(str(tmp_path / "missing.json"), "--vae")
    assert str(e.value) == f"--vae {tmp_path}/missing.json: cannot read (No such file or directory)"
    with pytest.raises(DataError, match=r"^\S+/bad.json: cannot parse JSON \(Expecting property name"):
        read_json(str(tmp_path / "bad.json"), error=DataError)
    with pytest.raises(ConfigError, match=r"latin.json: cannot parse JSON \(.*utf-8"):
        read_json(str(tmp_path / "latin.json"))
    with pytest.raises(ConfigError) as e:
        read_json(str(tmp_path / "list.json"))
    assert str(e.value) == f'{tmp_path}/list.json: holds a JSON list; expected a JSON object ({{"key": value, ...}})'
    assert "\n" not in str(e.value)
