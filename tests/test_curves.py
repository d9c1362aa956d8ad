"""Training curves: the record <save>/curves.jsonl (`train/curves.py`), the end-of-run <save>/curves.png and the figure
of several runs (`train/curves_plot.py`, launch/plot_curves.py), and --curves-reference.

In-process DMD2 runs (world of one, debug model on digits, B=4, K=2; the session's debug teacher), --log-interval 2,
--eval-interval 3 (16 samples), --save-interval 2, 6 cycles:
  straight   6 cycles: the record is train lines at 2, 4, 6 (each the mean of the --loss-trace's cycles since the
             last line: same values, same arithmetic) and eval lines at 3, 6 (the numbers of the eval's result);
             TensorBoard holds the same values (float32)
  crashed    the same, killed in the save of cycle 6 (after the train line of 6): the checkpoint of 4 is the last
  resumed    --load the crashed run: its record equals the straight run's, line for line (the train line of 6 the
             crash left is dropped and written again; a resume is bit-exact, so the values are equal too)
"""
import errno
import json
import math
import os

import pytest
from PIL import Image

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.train import checkpoint
from dmd2_mega.train.checkpoint import latest_iteration
from dmd2_mega.train.curves import CurveRecord, read_curves
from dmd2_mega.train.curves_plot import DPI, PANEL_INCHES, TITLES, draw_curves, panels, plot_run
from dmd2_mega.teacher_trainer import FlowTrainer
from launch import plot_curves
from tests.utils import RESUMABLE_FLOW, read_trace, resumable_dmd2_args, world_of_one

pytestmark = pytest.mark.timeout(240)

PANEL_PX = (int(PANEL_INCHES[0] * DPI), int(PANEL_INCHES[1] * DPI))
GAP = "dmd-fake-real-gap"


def png_size(path) -> tuple:
    """(width, height) of a PNG file, after PIL has checked it is one."""
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.verify()
        return im.size


def fake_run(evals=(3, 6), trains=(2, 4, 6), fd0=5.0, gap0=0.05) -> list:
    """A DMD2 run's records, as the trainer writes them."""
    out = [{"kind": "train", "unit": "cycle", "iteration": i, GAP: gap0 / i, "critic-loss": 0.5, "actor-dmd-loss": 1e-3}
           for i in trains]
    out += [{"kind": "eval", "unit": "cycle", "iteration": i, "frechet_distance": fd0 / i, "class_accuracy": 0.9,
             "diversity": 0.8, "num_samples": 16, "classifier_heldout_accuracy": 0.98} for i in evals]
    return sorted(out, key=lambda r: r["iteration"])


def write_records(path, records) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


# ---- the record ------------------------------------------------------------------------------------------------

def test_record_keeps_proxies_and_numbers_flushes_and_reads_back(tmp_path):
    path = str(tmp_path / "curves.jsonl")
    rec = CurveRecord(path, "cycle", 0)
    rec.train(2, {GAP: 0.25, "critic-loss": float("nan"), "critic-lr": 1e-3, "resident-MB-actor": 3.0})
    assert read_curves(path) == [{"kind": "train", "unit": "cycle", "iteration": 2, GAP: 0.25,
                                  "critic-loss": pytest.approx(float("nan"), nan_ok=True)}]  # flushed: seen at once
    rec.eval(3, {"weights": "raw", "grid": "a.png", "frechet_distance": 2.5, "class_accuracy": None,
                 "num_samples": 16, "flag": True})
    rec.train(4, {"critic-lr": 1e-3})  # no proxy in it: no line
    rec.close()
    records = read_curves(path)
    assert records[1] == {"kind": "eval", "unit": "cycle", "iteration": 3, "frechet_distance": 2.5, "num_samples": 16}
    assert len(records) == 2 and math.isnan(records[0]["critic-loss"])


def test_reopening_at_a_resumed_iteration_drops_the_later_lines_and_a_torn_one(tmp_path):
    path = str(tmp_path / "curves.jsonl")
    records = fake_run(evals=(3, 6, 9), trains=range(1, 10))
    write_records(path, records)
    with open(path, "a") as f:
        f.write('{"kind": "train", "unit": "cycle", "itera')  # a crash in the middle of a write
    rec = CurveRecord(path, "cycle", 5)
    assert read_curves(path) == [r for r in records if r["iteration"] <= 5]
    rec.train(6, {GAP: 1.0})
    rec.close()
    with open(path) as f:
        lines = f.read().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3, 3, 4, 5, 6]
    CurveRecord(path, "cycle", 0).close()  # a fresh run into the same --save starts a fresh curve
    assert read_curves(path) == []


def test_a_record_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path, capsys):
    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # the buffered bytes cannot be flushed either
    path = str(tmp_path / "curves.jsonl")
    rec = CurveRecord(path, "cycle", 0)
    rec.train(1, {GAP: 1.0})
    rec.file = FullDisk()
    rec.train(2, {GAP: 1.0})
    rec.eval(2, {"frechet_distance": 1.0})
    rec.close()
    assert capsys.readouterr().out == (f"> WARNING: cannot write the curves record {path} (No space left on device); "
                                       f"it stops here, the run goes on\n")
    assert [r["iteration"] for r in read_curves(path)] == [1]


# ---- --curves-reference --------------------------------------------------------------------------------------

def test_curves_reference_flag_parses_repeats_and_splits_at_the_last_equals(tmp_path):
    cfg = parse_flow_args(["--save", str(tmp_path / "s"), "--eval-interval", "5",
                           "--curves-reference", "teacher 50 steps=1.307", "--curves-reference", "CFG=1.25 run = 2e-1"])
    assert cfg.train.curve_references() == [("teacher 50 steps", 1.307), ("CFG=1.25 run", 0.2)]
    cfg = parse_dmd2_args(["--teacher-load", str(tmp_path / "t"), "--save", str(tmp_path / "s"), "--eval-interval",
                           "5", "--curves-reference", "t=3"])
    assert cfg.train.curve_references() == [("t", 3.0)]
    assert parse_flow_args([]).train.curve_references() == []


@pytest.mark.parametrize("text", ["1.307", "=1.3", " =1.3", "teacher=", "teacher=abc", "teacher=nan", "teacher=inf"])
def test_curves_reference_flag_rejects_what_is_not_name_equals_number(tmp_path, text):
    with pytest.raises(ConfigError, match=r"--curves-reference .*expected NAME=VALUE with a finite number VALUE"):
        parse_flow_args(["--save", str(tmp_path), "--eval-interval", "5", "--curves-reference", text])


@pytest.mark.parametrize("missing", ["--save", "--eval-interval"])
def test_curves_reference_flag_needs_save_and_eval_interval(tmp_path, missing):
    given = {"--save": str(tmp_path), "--eval-interval": "5"}
    given.pop(missing)
    with pytest.raises(ConfigError, match=r"--curves-reference is drawn on the eval metric's panel of "
                                          r"<save>/curves.png; give --save DIR and --eval-interval N with it"):
        parse_flow_args([*sum(given.items(), ()), "--curves-reference", "t=1"])


# ---- the figure ------------------------------------------------------------------------------------------------

def test_panels_follow_what_the_runs_recorded():
    digits = [r for r in fake_run()]
    user_data = [r for r in digits if r["kind"] == "train"]  # no eval metric: the proxy panels only
    teacher = [{"kind": "train", "unit": "iteration", "iteration": i, "loss": 1.0 / i} for i in (5, 10)]
    titles = [TITLES["frechet_distance"] + ", 16 samples", "accuracy, diversity (real data ~1)", TITLES[GAP], "losses"]
    assert [p.title for p in panels([("a", digits)])] == titles
    assert [p.title for p in panels([("a", user_data)])] == titles[2:]
    assert [(p.title, p.keys, p.log_scale) for p in panels([("t", teacher)])] == [("losses", ("loss",), True)]
    assert panels([("a", digits)])[1].keys == ("class_accuracy", "diversity")  # not the classifier's own accuracy
    negative = [dict(r, **{"critic-loss": -1.0}) for r in user_data]
    assert not panels([("a", negative)])[1].log_scale  # a log axis only when every value is > 0
    assert [p.title for p in panels([("a", digits)], metric="fd_ratio")] == titles[1:]  # a metric no run recorded


def test_figure_is_a_png_of_its_panels_and_the_reference_is_on_the_first_only(tmp_path):
    runs = [("4-step", fake_run()), ("1-step", fake_run(fd0=8.0, gap0=0.09))]
    plain, marked = str(tmp_path / "plain.png"), str(tmp_path / "marked.png")
    assert len(draw_curves(runs, plain)) == 4
    draw_curves(runs, marked, references=[("teacher", 1.2)])
    assert png_size(plain) == png_size(marked) == (4 * PANEL_PX[0], PANEL_PX[1])
    with Image.open(plain) as a, Image.open(marked) as b:
        a, b = a.convert("RGB"), b.convert("RGB")
        differs = [a.crop((k * PANEL_PX[0], 0, (k + 1) * PANEL_PX[0], PANEL_PX[1])).tobytes()
                   != b.crop((k * PANEL_PX[0], 0, (k + 1) * PANEL_PX[0], PANEL_PX[1])).tobytes() for k in range(4)]
    assert differs == [True, False, False, False]
    assert draw_curves([("a", [])], str(tmp_path / "none.png")) == [] and not os.path.exists(tmp_path / "none.png")


def test_end_of_run_plot_says_when_the_reference_has_no_panel(tmp_path):
    write_records(str(tmp_path / "curves.jsonl"), [r for r in fake_run() if r["kind"] == "train"])
    line = plot_run(str(tmp_path), [("teacher", 1.0)])
    assert "--curves-reference not drawn: no eval recorded a Frechet distance" in line
    assert png_size(tmp_path / "curves.png") == (2 * PANEL_PX[0], PANEL_PX[1])


# ---- launch/plot_curves.py -------------------------------------------------------------------------------------

def test_plot_curves_draws_runs_with_a_reference_from_a_report_json(tmp_path, capsys):
    write_records(str(tmp_path / "a" / "curves.jsonl"), fake_run())
    write_records(str(tmp_path / "b" / "curves.jsonl"), fake_run(fd0=9.0))
    row = "teacher, 50 Euler steps, CFG 1.25"
    report = tmp_path / "metrics.json"
    report.write_text(json.dumps({row: {"frechet_distance": 1.3188, "class_accuracy": 0.99, "num_samples": 2000},
                                  "other": {}}))
    out = str(tmp_path / "curves.png")
    assert plot_curves.main(["--out", out, "--run", f"4-step={tmp_path / 'a'}", "--run", f"1-step={tmp_path / 'b'}",
                             "--reference-json", f"{report}:{row}", "--reference", "x=2"]) == 0
    assert f"reference x 2; {row} (2000 samples) 1.319" in capsys.readouterr().out  # --reference lines first
    assert png_size(out) == (4 * PANEL_PX[0], PANEL_PX[1])


@pytest.mark.parametrize("case", ["missing record", "no pair", "no row", "no metric", "bad reference"])
def test_plot_curves_errors_name_what_to_fix(tmp_path, capsys, case):
    write_records(str(tmp_path / "a" / "curves.jsonl"), fake_run())
    (tmp_path / "m.json").write_text(json.dumps({"teacher": {"frechet_distance": 1.0}}))
    run, more = f"a={tmp_path / 'a'}", []
    expected = {"missing record": f"--run s={tmp_path / 'empty'}: {tmp_path / 'empty'} holds no curves.jsonl",
                "no pair": "--run 'just a dir': expected NAME=DIR",
                "no row": f"--reference-json {tmp_path / 'm.json'}: no row 'student'; its rows: 'teacher'",
                "no metric": "--metric fid: no run's eval recorded it (their eval metrics: frechet_distance, ",
                "bad reference": "--reference 'teacher': expected NAME=VALUE"}[case]
    if case == "missing record":
        run = f"s={tmp_path / 'empty'}"
    elif case == "no pair":
        run = "just a dir"
    elif case == "no row":
        more = ["--reference-json", f"{tmp_path / 'm.json'}:student"]
    elif case == "no metric":
        more = ["--metric", "fid"]
    else:
        more = ["--reference", "teacher"]
    out = tmp_path / "c.png"
    assert plot_curves.main(["--out", str(out), "--run", run, *more]) == 1
    err = capsys.readouterr().err
    assert f"ConfigError: {expected}" in err, err
    assert not out.exists()


# ---- the trainer writes it -------------------------------------------------------------------------------------

RUN = ["--train-iters", "6", "--log-interval", "2", "--eval-interval", "3", "--eval-num-samples", "16",
       "--save-interval", "2", "--curves-reference", "teacher=40"]


class Crash(BaseException):
    """A kill in the middle of a save (not an Exception: the save's clean-up does not see it)."""


def dmd2(teacher: str, argv: list) -> dict:
    with world_of_one():
        return DMD2Trainer(parse_dmd2_args(resumable_dmd2_args(teacher) + RUN + argv)).train()


@pytest.fixture(scope="module")
def runs(debug_teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("curves")
    straight, split = str(d / "straight"), str(d / "split")
    last_eval = dmd2(debug_teacher, ["--save", straight, "--loss-trace", str(d / "trace.jsonl"),
                                     "--tensorboard-dir", str(d / "tb")])

    def kill_point(stage, iteration):
        if stage == "before-tracker" and iteration == 6:
            raise Crash(stage)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "kill_point", kill_point)
        with pytest.raises(Crash):
            dmd2(debug_teacher, ["--save", split])
    crashed = read_curves(os.path.join(split, "curves.jsonl"))
    assert latest_iteration(split) == 4
    dmd2(debug_teacher, ["--save", split, "--load", split])
    return {"straight": straight, "split": split, "crashed": crashed, "last_eval": last_eval,
            "trace": read_trace(str(d / "trace.jsonl")), "tb": str(d / "tb")}


def test_record_has_a_line_per_log_interval_and_per_eval(runs):
    records = read_curves(os.path.join(runs["straight"], "curves.jsonl"))
    assert [(r["kind"], r["iteration"]) for r in records] == [("train", 2), ("eval", 3), ("train", 4), ("train", 6),
                                                              ("eval", 6)]
    assert all(r["unit"] == "cycle" for r in records)
    trace = {r["iteration"]: r for r in runs["trace"]}
    for r in (r for r in records if r["kind"] == "train"):
        assert set(r) == {"kind", "unit", "iteration", GAP, "critic-loss", "actor-dmd-loss"}
        for key in (GAP, "critic-loss", "actor-dmd-loss"):  # the interval's mean, as the logger takes it
            cycles = [trace[i][key] for i in (r["iteration"] - 1, r["iteration"])]
            assert r[key] == sum(cycles) / len(cycles), (r, key)
    last = records[-1]
    expected = {k: v for k, v in runs["last_eval"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {k: v for k, v in last.items() if k not in ("kind", "unit", "iteration")} == expected
    assert {"frechet_distance", "class_accuracy", "diversity"} <= set(expected)


def test_tensorboard_holds_the_same_curves(runs):
    """The eval metric (eval/*) and the proxy (train/*) as TensorBoard scalars: the record's values, in float32."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(runs["tb"])
    acc.Reload()
    for r in read_curves(os.path.join(runs["straight"], "curves.jsonl")):
        tag, key = ("eval/frechet_distance", "frechet_distance") if r["kind"] == "eval" else ("train/" + GAP, GAP)
        (event,) = [e for e in acc.Scalars(tag) if e.step == r["iteration"]]
        assert event.value == pytest.approx(r[key], rel=2 ** -23), (tag, r)


def test_resumed_record_equals_the_uninterrupted_one(runs):
    assert [(r["kind"], r["iteration"]) for r in runs["crashed"]] == [("train", 2), ("eval", 3), ("train", 4),
                                                                      ("train", 6)]
    straight = read_curves(os.path.join(runs["straight"], "curves.jsonl"))
    resumed = read_curves(os.path.join(runs["split"], "curves.jsonl"))
    assert resumed == straight  # bit-exact: the resume restores every state, the values are the same arithmetic


def test_teacher_run_records_its_loss_per_iteration_interval(tmp_path):
    save, trace = str(tmp_path / "teacher"), str(tmp_path / "trace.jsonl")
    with world_of_one():
        FlowTrainer(parse_flow_args(RESUMABLE_FLOW + ["--train-iters", "4", "--log-interval", "2", "--save", save,
                                                      "--loss-trace", trace])).train()
    losses = {r["iteration"]: r["loss"] for r in read_trace(trace)}
    assert read_curves(os.path.join(save, "curves.jsonl")) == [
        {"kind": "train", "unit": "iteration", "iteration": i, "loss": (losses[i - 1] + losses[i]) / 2} for i in (2, 4)]
    assert png_size(os.path.join(save, "curves.png")) == PANEL_PX  # the losses panel alone


def test_run_ends_with_its_curves_png(runs):
    assert png_size(os.path.join(runs["straight"], "curves.png")) == (4 * PANEL_PX[0], PANEL_PX[1])
    assert png_size(os.path.join(runs["split"], "curves.png")) == (4 * PANEL_PX[0], PANEL_PX[1])
