"""prepare_data's inputs: a malformed captions file, a second run on one --out, a binary --prompts file.

Issue 27 found that each of these lost data or stopped with a traceback:
  * captions (dmd2_mega/prep/clips.py): an unclosed quote swallowed the rows after it into one caption and the
    run still exited 0; an unquoted comma cut a caption short; an over-long field (csv's limit, 131072
    characters, which a quote left open in a large file reaches) was a bare `_csv.Error` traceback.
    `read_captions` is checked directly: each malformed row refuses the file naming its line, or with
    `skip_bad=True` is left out and returned with its line, and costs that row only; legitimately quoted
    commas, line breaks and quotes are kept exactly. One end-to-end run (the KL image VAE of
    tests/test_prepare_data.py's fixture) checks that --skip-bad-captions lists the rows in report.json and
    that the summary counts rows read, rows left out and clips written; without the flag, exit 1 and one line.
  * --out: two runs on one directory both encoded everything and the second deleted the first's temporary
    shard file. A child process holds the trainers' lock (`dir_lock.acquire`) on --out: the run exits 1 with
    one line naming the holder and leaves --out untouched; once the holder has ended, a run takes the lock
    over and writes the shards.
  * --prompts-only given a binary file (a .safetensors file, UTF-16 text with its NUL bytes): one DataError
    line saying that --prompts takes a text file and sample.py --prompts the .safetensors file.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from dmd2_mega.errors import DataError
from dmd2_mega.prep.clips import Clip, read_captions
from launch import prepare_data
from tests.test_prepare_data import L, ROOT, setup, tiny_models  # noqa: F401  (setup: the tiny models and media)

pytestmark = pytest.mark.timeout(120)
INTEGRATION_FIXTURES = ("setup",)  # it encodes an mp4 with ffmpeg, a process


def _captions(tmp_path, text, name="captions.csv"):
    path = tmp_path / name
    path.write_bytes(text.encode())
    return str(path)


def _twelve(bad_row=None, bad=""):
    """A 12-clip captions CSV (rows on lines 2-13) whose row `bad_row` has `bad` put before its caption."""
    return "path,caption\n" + "".join(f"clip{i:02d}.gif,{bad if i == bad_row else ''}caption {i}\n"
                                      for i in range(12))


def test_unclosed_quote_refuses_naming_its_line(tmp_path):
    path = _captions(tmp_path, _twelve(3, '"'))
    with pytest.raises(DataError, match=r"1 malformed of 12 rows \(line 5: .*quote") as e:
        read_captions(path, True, 5)
    assert "--skip-bad-captions" in str(e.value) and path in str(e.value)


def test_unclosed_quote_costs_its_row_only(tmp_path):
    got = read_captions(_captions(tmp_path, _twelve(3, '"')), True, 5, skip_bad=True)
    assert [c.path for c in got.clips] == [f"clip{i:02d}.gif" for i in range(12) if i != 3]
    assert all(c.caption == f"caption {int(c.path[4:6])}" for c in got.clips)
    assert got.rows == 12 and [b["line"] for b in got.bad] == [5]


def test_quote_closed_rows_later_is_the_opening_row_only(tmp_path):
    text = 'path,caption\nclip00.gif,a\nclip01.gif,"b\nclip02.gif,c\nclip03.gif,d"\nclip04.gif,e\n'
    got = read_captions(_captions(tmp_path, text), True, 5, skip_bad=True)
    assert [c.path for c in got.clips] == ["clip00.gif", "clip02.gif", "clip03.gif", "clip04.gif"]
    assert got.clips[1].caption == "c"
    assert got.rows == 5 and len(got.bad) == 1
    assert got.bad[0]["line"] == 3 and "lines 4-5" in got.bad[0]["reason"]


def test_unquoted_comma_refuses_naming_line_and_field_count(tmp_path):
    path = _captions(tmp_path, "path,caption\nclip00.gif,a cat, runs on the grass\nclip01.gif,dog\n")
    with pytest.raises(DataError, match=r"line 2: 3 fields where the header has 2"):
        read_captions(path, True, 5)
    got = read_captions(path, True, 5, skip_bad=True)
    assert [(c.path, c.caption) for c in got.clips] == [("clip01.gif", "dog")]
    assert got.rows == 2 and [b["line"] for b in got.bad] == [2]


def test_over_long_field_is_a_data_error_naming_its_line(tmp_path):
    path = _captions(tmp_path, f'path,caption\nclip00.gif,ok\nclip01.gif,"{"x" * 140_000}"\nclip02.gif,dog\n')
    with pytest.raises(DataError, match=r"line 3: .*field limit"):
        read_captions(path, True, 5)
    got = read_captions(path, True, 5, skip_bad=True)
    assert [c.path for c in got.clips] == ["clip00.gif", "clip02.gif"] and [b["line"] for b in got.bad] == [3]


def test_unclosed_quote_in_a_large_file_costs_its_row_only(tmp_path):
    """The issue's traceback: a quote left open runs past csv's field limit in a large file."""
    rows = [f"clip{i:04d}.gif,a caption of some length for row number {i}\n" for i in range(3000)]
    rows[4] = rows[4].replace(",a caption", ',"a caption')
    path = _captions(tmp_path, "path,caption\n" + "".join(rows))
    with pytest.raises(DataError, match=r"1 malformed of 3000 rows \(line 6: "):
        read_captions(path, True, 5)
    got = read_captions(path, True, 5, skip_bad=True)
    assert len(got.clips) == 2999 and "clip0004.gif" not in {c.path for c in got.clips}
    assert got.clips[4] == Clip("clip0005.gif", "a caption of some length for row number 5")
    assert [b["line"] for b in got.bad] == [6]


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_quoted_comma_line_break_and_quotes_are_kept(tmp_path, eol):
    text = eol.join(['path,caption', 'clip00.gif,"a cat, a dog"', 'clip01.gif,"line one\nline two"',
                     'clip02.gif,"say ""hi"""', 'clip03.gif,"two\n\nblank lines"', '']) + eol
    got = read_captions(_captions(tmp_path, text), True, 5)
    assert [c.caption for c in got.clips] == ["a cat, a dog", "line one\nline two", 'say "hi"',
                                              "two\n\nblank lines"]
    assert got.rows == 4 and got.bad == []


def test_refusal_quotes_three_rows_and_counts_the_rest(tmp_path):
    text = "path,caption\n" + "".join(f"clip{i:02d}.gif,{'a, b' if i % 2 else 'ok'}\n" for i in range(10))
    with pytest.raises(DataError, match=r"5 malformed of 10 rows \(line 3: .*; line 5: .*; line 7: [^;]*; "
                                        r"and 2 more\)"):
        read_captions(_captions(tmp_path, text), True, 5)


def test_jsonl_bad_rows_are_listed_by_line(tmp_path):
    text = ('{"path": "a.gif", "caption": "x"}\n{"path": "b.gif", "caption": \n[1, 2]\n\n'
            '{"path": "c.gif", "caption": 3}\n{"path": "d.gif", "caption": "y"}\n')
    path = _captions(tmp_path, text, "captions.jsonl")
    with pytest.raises(DataError, match=r"3 malformed of 5 rows \(line 2: not a JSON object .*; line 3: .*list; "
                                        r"line 5: .*caption=3\)"):
        read_captions(path, True, 5)
    got = read_captions(path, True, 5, skip_bad=True)
    assert [(c.path, c.caption) for c in got.clips] == [("a.gif", "x"), ("d.gif", "y")]
    assert [b["line"] for b in got.bad] == [2, 3, 5]


def _image_args(d, captions, out, *extra):
    return ["--vae", str(d / "klvae"), "--text-encoder", str(d / "pipe" / "text_encoder"), "--media",
            str(d / "images"), "--captions", str(captions), "--out", str(out), "--height", "16", "--width", "16",
            "--max-text-len", str(L), "--workers", "0", "--dtype", "fp32", *extra]


def test_skip_bad_captions_end_to_end(setup, tmp_path, capsys):  # noqa: F811
    captions = _captions(tmp_path, 'path,caption\np2.png,a cat, runs on the grass\np3.png,"dog runs\n'
                                   'p1.png,a cat\n')
    out = tmp_path / "out"
    assert prepare_data.run(_image_args(setup, captions, out)) == 1
    printed = capsys.readouterr()
    err = printed.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"DataError: --captions {captions}: 2 malformed of 3 rows"), err
    assert "line 2: 3 fields" in err[0] and "line 3: " in err[0] and "--skip-bad-captions" in err[0]
    assert printed.out == "" and not out.exists()

    assert prepare_data.run(_image_args(setup, captions, out, "--skip-bad-captions")) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["caption_rows_read"] == 3 and [b["line"] for b in report["caption_rows_skipped"]] == [2, 3]
    assert report["caption_rows_skipped"][0]["reason"].startswith("3 fields where the header has 2")
    assert report["clips_written"] == 1 and report["clips_total"] == 1
    assert "3 caption rows read, 2 malformed left out; 1 of 1 clips written" in printed
    for b in report["caption_rows_skipped"]:
        assert f"  line {b['line']}: {b['reason']}" in printed
    with open(out / "shard_00000.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["written"]) == ["p1.png"]


HOLD = """import sys
sys.path.insert(0, {root!r})
from dmd2_mega.files.dir_lock import acquire
acquire({out!r}, "--save")
print("locked", flush=True)
sys.stdin.readline()
"""


def _listing(out):
    return {n: ((out / n).stat().st_mtime_ns, (out / n).read_bytes()) for n in sorted(os.listdir(out))}


@pytest.mark.integration
def test_second_run_on_a_locked_out_refuses_then_takes_over(setup, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "shard_00000.safetensors.k2x9_a.tmp"  # the holder's shard being written
    stale.write_bytes(b"half a shard")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, out=str(out))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        before = _listing(out)
        args = _image_args(setup, setup / "images" / "captions.jsonl", out, "--shard-size", "2")
        assert prepare_data.run(args) == 1
        printed = capsys.readouterr()
        err = printed.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"DataError: --out {out} is in use by another run"), err
        assert f"pid {holder.pid}," in err[0]
        assert printed.out == "" and _listing(out) == before
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0

    assert prepare_data.run(args) == 0
    printed = capsys.readouterr().out
    assert f"took over the lock of {out} left by " in printed and f"pid {holder.pid}," in printed
    assert "(no longer running)" in printed
    assert not stale.exists()
    assert json.loads((out / "report.json").read_text())["clips_written"] == 3


@pytest.mark.parametrize("kind", ["safetensors", "utf16"])
def test_binary_prompts_file_is_one_line(setup, tmp_path, capsys, kind):  # noqa: F811
    prompts = tmp_path / f"prompts.{kind}"
    if kind == "safetensors":
        save_file({"cond": torch.ones(2, 3)}, str(prompts))
    else:
        prompts.write_bytes("a cat runs\nthe blue sky\n".encode("utf-16-le"))
    out = tmp_path / "eval.safetensors"
    assert prepare_data.run(["--prompts-only", "--pipeline", str(setup / "pipe"), "--prompts", str(prompts),
                             "--out", str(out), "--max-text-len", str(L)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"DataError: --prompts {prompts}: not a text file ("), err
    assert ("not UTF-8" if kind == "safetensors" else "a NUL byte on line 1") in err[0]
    assert "--prompts takes a text file, one prompt a line" in err[0]
    assert "sample.py --prompts takes the .safetensors file" in err[0]
    assert not out.exists()
