"""What launch/plot_curves.py writes and what it reads (issue 50): nothing of a run is replaced, nothing is skipped
without a word.

--out: a .png (checked before anything is read or written), never an existing file that is not a PNG (its first
bytes), never a run's end-of-run curves.png (beside its curves.jsonl), never an existing file inside a run's --save
folder unless a plot of curves drew it (draw_curves' PNG text mark), so a figure is redrawn in place and a run's grids
are not. --run: one NAME per run. curves.jsonl (train/curves.read_curves, shared with the end-of-run figure and a
resume's reopening): a torn last line is a warning naming the file and the line; any other line that is no record is
a DataError naming the file and its lines (the end-of-run figure: a warning, the run does not fail; a resume: the
lines dropped with a warning naming them). Each error is one line and exit status 1, with nothing written.
"""
import json
import os

import pytest
from PIL import Image

from dmd2_mega.train.curves import CurveRecord, read_curves
from dmd2_mega.train.curves_plot import plot_run
from launch import plot_curves
from tests.test_curves import fake_run, png_size, write_records

pytestmark = pytest.mark.timeout(120)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # the first 8 bytes of every PNG file


@pytest.fixture
def runs(tmp_path):
    """Two runs' --save folders a/ and b/, each with its curves.jsonl."""
    write_records(str(tmp_path / "a" / "curves.jsonl"), fake_run())
    write_records(str(tmp_path / "b" / "curves.jsonl"), fake_run(fd0=9.0))
    return tmp_path


def plot(*argv) -> int:
    return plot_curves.main([str(a) for a in argv])


def error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


# ---- --out -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a/curves.jsonl", "x.txt", "figure"])
def test_out_must_name_a_png(runs, capsys, name):
    """`--out a/curves.jsonl --run b=b` replaced run a's record with PNG bytes; `--out x.txt` was accepted."""
    out = runs / name
    before = out.read_bytes() if out.exists() else None
    assert plot("--out", out, "--run", f"b={runs / 'b'}") == 1
    assert f"ConfigError: --out {out}: expected a file name ending in .png (the figure is a PNG)" in error(capsys)
    assert (out.read_bytes() if out.exists() else None) == before


def test_out_never_replaces_a_file_that_is_not_a_png(runs, capsys):
    out = runs / "notes.png"
    out.write_text("my notes, named .png by mistake\n")
    assert plot("--out", out, "--run", f"b={runs / 'b'}") == 1
    assert (f"ConfigError: --out {out} is an existing file that is not a PNG; it is not replaced: choose another "
            f"--out (nothing was written)") in error(capsys)
    assert out.read_text() == "my notes, named .png by mistake\n"


def test_out_is_never_a_runs_own_figure(runs, capsys):
    """<run>/curves.png is the run's end-of-run figure (drawn or not yet): another run's curves never take it."""
    out = runs / "a" / "curves.png"
    assert plot("--out", out, "--run", f"b={runs / 'b'}") == 1
    assert f"ConfigError: --out {out} is the end-of-run figure of the run in {runs / 'a'}" in error(capsys)
    assert not out.exists()
    plot_run(str(runs / "a"))
    before = out.read_bytes()
    assert plot("--out", out, "--run", f"a={runs / 'a'}", "--run", f"b={runs / 'b'}") == 1
    assert "is the end-of-run figure of the run in" in error(capsys)
    assert out.read_bytes() == before


def test_out_in_a_run_folder_replaces_only_a_figure_of_curves(runs, capsys):
    """A run's own PNG (an eval grid) is not replaced; a figure plot_curves drew there is drawn again."""
    grid = runs / "a" / "samples" / "grid.png"
    grid.parent.mkdir()
    Image.new("RGB", (8, 8), "white").save(grid)
    before = grid.read_bytes()
    assert plot("--out", grid, "--run", f"b={runs / 'b'}") == 1
    assert (f"ConfigError: --out {grid} is a file of the run in {runs / 'a'} (a --save folder: it holds curves.jsonl) "
            f"that no plot of curves drew; it is not replaced") in error(capsys)
    assert grid.read_bytes() == before
    mine = runs / "a" / "beside_b.png"
    for _ in range(2):  # new, then drawn again in place
        assert plot("--out", mine, "--run", f"a={runs / 'a'}", "--run", f"b={runs / 'b'}") == 0
        assert png_size(mine)[0] > 0


def test_out_outside_the_runs_may_be_redrawn(runs, capsys):
    """The quickstarts' $RUN_DIR/curves.png: an existing PNG in no run folder is replaced."""
    out = runs / "curves.png"
    Image.new("RGB", (8, 8), "white").save(out)
    assert plot("--out", out, "--run", f"a={runs / 'a'}") == 0
    assert png_size(out) != (8, 8) and out.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("case", ["folder", "under a file"])
def test_out_is_a_file_to_write(runs, capsys, case):
    if case == "folder":
        out, expected = runs / "fig.png", f"--out {runs / 'fig.png'} is a folder; expected the .png file to write"
        out.mkdir()
    else:
        (runs / "plain").write_text("x")
        out, expected = runs / "plain" / "fig.png", f"--out {runs / 'plain' / 'fig.png'}: {runs / 'plain'} is a file"
    assert plot("--out", out, "--run", f"a={runs / 'a'}") == 1
    assert f"ConfigError: {expected}" in error(capsys)


# ---- --run -----------------------------------------------------------------------------------------------------

def test_two_runs_of_one_name_are_refused(runs, capsys):
    out = runs / "c.png"
    assert plot("--out", out, "--run", f"x={runs / 'a'}", "--run", f" x ={runs / 'b'}") == 1
    assert (f"ConfigError: --run  x ={runs / 'b'}: the name 'x' is given twice (also --run x={runs / 'a'}); each run "
            f"needs its own NAME") in error(capsys)
    assert not out.exists()


# ---- curves.jsonl ----------------------------------------------------------------------------------------------

def test_a_line_no_run_wrote_is_an_error_naming_file_and_lines(runs, capsys):
    path = runs / "b" / "curves.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1:1] = ["garbage\n"]
    lines[4:4] = ['{"kind": "train", "iteration": "7"}\n', "\n", "[1, 2]\n"]  # a blank line is no loss: not counted
    path.write_text("".join(lines))
    out = runs / "c.png"
    assert plot("--out", out, "--run", f"a={runs / 'a'}", "--run", f"b={runs / 'b'}") == 1
    assert (f"DataError: --run b={runs / 'b'}: {path}: lines 2, 5, 7 are no curves record (expected a JSON object "
            f"with an integer \"iteration\" per line, as the trainers write it; no run wrote them): fix or remove "
            f"them") in error(capsys)
    assert not out.exists()


def test_many_bad_lines_are_counted_and_bytes_that_are_no_text_are_bad_lines(runs, capsys):
    """A record overwritten by a PNG (what --out a/curves.jsonl did) is a DataError, not a traceback."""
    path = runs / "b" / "curves.jsonl"
    path.write_bytes(PNG_MAGIC + b"\x00\xff\xfe\n" * 12 + b"\x00")  # 14 lines (PNG's signature holds 2), a torn 15th
    assert plot("--out", runs / "c.png", "--run", f"b={runs / 'b'}") == 1
    err = error(capsys)
    assert f"DataError: --run b={runs / 'b'}: {path}: lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... (14 in all) are" in err


def test_a_torn_last_line_is_a_warning_and_the_rest_is_drawn(runs, capsys):
    path = runs / "b" / "curves.jsonl"
    n = len(path.read_text().splitlines())
    with open(path, "a") as f:
        f.write('{"kind": "train", "unit": "cycle", "itera')  # a crash in mid-write, or a write in progress
    out = runs / "c.png"
    assert plot("--out", out, "--run", f"b={runs / 'b'}") == 0
    printed = capsys.readouterr().out
    assert (f"> WARNING: {path} line {n + 1}: a torn last line (a crash in mid-write, or a write in progress), left "
            f"out\n") in printed
    assert png_size(out)[0] > 0
    assert read_curves(str(path)) == fake_run(fd0=9.0)


def test_a_whole_last_line_without_its_newline_is_a_record(tmp_path, capsys):
    path = tmp_path / "curves.jsonl"
    records = fake_run()
    path.write_text("\n".join(json.dumps(r) for r in records))  # written by hand, no newline at the end
    assert read_curves(str(path)) == records
    assert capsys.readouterr().out == ""
    CurveRecord(str(path), "cycle", 6).close()  # reopened by a resume: kept, and given its newline
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in records)


def test_end_of_run_figure_of_a_changed_record_is_a_warning_not_a_failure(tmp_path):
    path = tmp_path / "curves.jsonl"
    write_records(str(path), fake_run())
    with open(path, "a") as f:
        f.write("edited by hand\n")
    line = plot_run(str(tmp_path))
    assert line.startswith(f"> WARNING: curves not drawn: {path}: line 6 is no curves record")
    assert not (tmp_path / "curves.png").exists()


def test_end_of_run_figure_never_replaces_a_file_that_is_not_a_png(tmp_path):
    write_records(str(tmp_path / "curves.jsonl"), fake_run())
    (tmp_path / "curves.png").write_text("not a figure")
    line = plot_run(str(tmp_path))
    assert line == (f"> WARNING: curves not drawn: {tmp_path / 'curves.png'} is an existing file that is not a PNG; "
                    f"it is not replaced")
    assert (tmp_path / "curves.png").read_text() == "not a figure"


def test_reopening_names_the_lines_it_drops(tmp_path, capsys):
    path = tmp_path / "curves.jsonl"
    records = fake_run(evals=(3,), trains=(1, 2, 4))
    text = [json.dumps(r) + "\n" for r in records]
    text.insert(2, "not json\n")
    path.write_text("".join(text))
    CurveRecord(str(path), "cycle", 3).close()
    assert capsys.readouterr().out == (f"> WARNING: the curves record {path}: line 3 is no record (not a JSON object "
                                       f"with an integer \"iteration\"), dropped as the record is reopened at "
                                       f"iteration 3\n")
    assert read_curves(str(path)) == [r for r in records if r["iteration"] <= 3]
