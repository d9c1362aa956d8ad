"""The benchmarks take any family through the contract (issue 28 item 5): no file of benchmarks/ names a family
(the acceptance grep), `--data synthetic` writes what the family of `--model-size` takes (labels for the DiT, text
embeddings for Wan: `ModelFamily.plan_data`), and plan_vs_measured.py runs the token-split layouts only for a family
that splits tokens. The benchmarks themselves are scripts, not tests: nothing here times anything."""
import json
import os
import re
from dataclasses import replace

import pytest
import torch

from benchmarks import bench_dmd2_cycle, plan_vs_measured
from benchmarks.pieces import Pieces
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.cycle import rollout_forwards, steps
from dmd2_mega.plan import memory_plan as mp
from tests.utils import world_of_one

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the acceptance grep of issue 28 item 5: grep -rnE "family\.name|== *['\"](wan|dit)['\"]|isinstance\([^)]*(Wan|DiT)"
FAMILY_BRANCH = re.compile(r"""family\.name|== *['"](wan|dit)['"]|isinstance\([^)]*(Wan|DiT)""")


def test_no_file_of_benchmarks_names_a_family():
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "benchmarks")):
        for name in files:
            if name.endswith((".py", ".sh", ".md")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    hits += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if FAMILY_BRANCH.search(line)]
    assert not hits, "\n".join(hits)
    assert FAMILY_BRANCH.search('if size.family.name == "wan":') and FAMILY_BRANCH.search("isinstance(m, Wan)")


@pytest.mark.parametrize("size, flags, latent, cond", [
    ("debug", ["--image-size", "8", "--num-classes", "10"], [4, 8, 8], {"cond": "labels", "num_classes": 10}),
    ("debug", ["--latent-shape", "3", "6", "6", "--cond-shape", "7", "12"], [3, 6, 6],
     {"cond": "embedding", "cond_shape": [7, 12]}),
    ("wan-debug", ["--latent-shape", "4", "2", "4", "4", "--text-len", "3"], [4, 2, 4, 4],
     {"cond": "embedding", "cond_shape": [3, 16]}),
])
def test_cycle_benchmark_synthetic_data_is_what_the_family_takes(tmp_path, size, flags, latent, cond):
    a = bench_dmd2_cycle.parse_args(["--model-size", size, "--data", "synthetic", *flags])
    with open(os.path.join(bench_dmd2_cycle.synthetic_shards(a, str(tmp_path), 5), "index.json")) as f:
        index = json.load(f)
    assert index["latent_shape"] == latent and {k: index[k] for k in cond} == cond
    assert sum(s["num_samples"] for s in index["shards"]) == 5


def test_cycle_benchmark_synthetic_data_refuses_a_shape_the_family_does_not_take(tmp_path):
    a = bench_dmd2_cycle.parse_args(["--model-size", "wan-debug", "--data", "synthetic"])  # no --latent-shape
    with pytest.raises(ConfigError, match="--latent-shape"):
        bench_dmd2_cycle.synthetic_shards(a, str(tmp_path), 5)


def test_plan_vs_measured_shapes_and_layouts_follow_the_family():
    wan = plan_vs_measured.parse_args([])  # the default run: wan-debug, 75 tokens, text [3, 16]
    ms = mp.model_shape_from_info(wan.model_size, plan_vs_measured.info(wan))
    assert (ms.tokens, ms.cond_shape) == (75, (3, 16))
    assert list(plan_vs_measured.layouts(ms)) == ["CP=2", "TP=2", "TP=2 SP"]
    dit = plan_vs_measured.parse_args(["--model-size", "debug", "--latent-shape", "4", "8", "8", "--num-classes", "10"])
    ms = mp.model_shape_from_info(dit.model_size, plan_vs_measured.info(dit))
    assert (ms.tokens, ms.num_classes, ms.cond_shape) == (16, 10, None)
    assert list(plan_vs_measured.layouts(ms)) == ["TP=2"]  # the DiT does not split tokens: no CP, no SP
    x, sigma, cond = plan_vs_measured.inputs(ms, 3)
    assert x.shape == (3, 4, 8, 8) and sigma.shape == (3,) and cond.shape == (3,) and int(cond.max()) < 10


def test_streaming_benchmark_runs_and_prints_its_ratio(capsys):
    """benchmarks/bench_streaming.py at a tiny size (nothing timed is asserted): its table and acceptance line."""
    from benchmarks import bench_streaming
    assert bench_streaming.main(["--latent", "1", "2", "16", "16", "--chunk-frames", "1", "--batch", "1",
                                 "--steps", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("window ", "full causal "))]
    assert [r[0] for r in rows] == ["window"] * 3 + ["full"] * 3
    assert "acceptance: streaming per-chunk time 2T / T with the window <= 1.2:" in out


def test_self_forcing_cycle_benchmark_runs_and_prints_its_ratio(capsys):
    """benchmarks/bench_self_forcing_cycle.py at a tiny size (nothing timed is asserted): the phases against their
    minimum, the chunk geometry it costs (T = 4 in chunks of 2: q = 1/2) and the acceptance line."""
    from benchmarks import bench_self_forcing_cycle
    with world_of_one():
        assert bench_self_forcing_cycle.main(["--data", "moving-digits", "--micro-batch-size", "1",
                                              "--dmd2-critic-steps-per-rollout", "1", "--warmup", "0",
                                              "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 chunks of [2, 2] frames (q = 0.500)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("rollout ", "critic ",
                                                                                          "actor ", "cycle "))}
    assert list(rows) == ["rollout", "critic", "actor", "cycle"] and all(float(r[2]) > 0 for r in rows.values())
    assert "acceptance: Self-Forcing cycle <= 1.1x analytic minimum:" in out


def test_gan_cycle_benchmark_runs_and_prints_its_cost_model(capsys):
    """benchmarks/bench_gan_cycle.py at a tiny size (nothing timed is asserted): B = 4, K = 2, 1 step, no CFG:
    DMD-only 2 + 6 + 1 + 3 = 12F; the head on block 1 of 4 (d = 1/2) adds 3 d (2 steps x 4 real / 4) + 3 d = 4.5F
    (--dmd2-gan-real-rows: B = 4 real rows per critic step)."""
    from benchmarks import bench_gan_cycle
    with world_of_one():
        out = bench_gan_cycle.main(["--micro-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2",
                                    "--dmd2-denoising-steps", "1", "--warmup", "0", "--repeats", "1"])
    text = capsys.readouterr().out
    assert "cost model: DMD-only cycle 12.00F, GAN cycle 16.50F -> 1.375x" in text, text
    assert "(feature block 1, d=0.50)" in text and "kernels torch" in text
    assert out["dmd_ms"] > 0 and out["gan_ms"] > 0 and "acceptance: GAN / DMD-only cycle <= 1.15:" in text


def _states(records) -> list:
    return [mb.generator_states() for mb in records]


def _same(a, b) -> bool:
    """Bit-equal generator states: [[state or None per generator] per micro-batch]."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _pieces_draw_what_the_cycle_draws(method, roles, records) -> dict:
    """Runs `method.cycle` on copies of `records`, noting the generator states as each phase starts, then each step
    alone through `Pieces` from the same records: each piece must start and end where the cycle starts and ends its
    phase. Returns {"result": the cycle's CycleResult, "pieces": the Pieces, "at": the states}."""
    assert all(mb.stop_gen.device.type == "cpu" and mb.stop_gen is not mb.rollout_gen for mb in records)
    before, in_cycle = [mb.snapshot() for mb in records], [mb.snapshot() for mb in records]
    at = {}  # generator states as each phase starts ("end": after the cycle)
    result = method.cycle(roles, in_cycle, hook=lambda phase: at.setdefault(phase, _states(in_cycle)))
    at["end"] = _states(in_cycle)
    names = [s.name for s in method.steps()]
    assert names == list(at)[:-1]
    pieces = Pieces(method.steps(), roles, before)
    for name, end in zip(names, names[1:] + ["end"]):
        used = pieces.records(name)
        assert _same(_states(used), at[name]), name
        pieces.run(name, records=used)
        assert _same(_states(used), at[end]), name
    return {"result": result, "pieces": pieces, "at": at}


def test_cycle_benchmark_pieces_draw_what_the_cycle_draws(tmp_path):
    """The cycle benchmark's standalone pieces (issue 49 item 2) are the method's own steps, each run on the micro-batch
    records it has inside `run_cycle`. With the stop steps on a host generator of their own, distinct from the noise
    generator (the trainer's records), each piece starts where the cycle starts its phase and leaves every generator
    bit-equal to where the cycle leaves it, and the rollout piece draws the cycle's stop steps (its forward count).
    The first GPU run's bug, stop steps drawn from the noise generator, consumes otherwise: checked to be seen."""
    with world_of_one():
        a = bench_dmd2_cycle.parse_args(["--model-size", "debug", "--micro-batch-size", "2",
                                         "--dmd2-critic-steps-per-rollout", "2", "--dmd2-denoising-steps", "3",
                                         "--dmd2-teacher-guidance-scale", "1.5"])
        h = bench_dmd2_cycle.Harness(a, str(tmp_path))
        h.at(3)
        out = _pieces_draw_what_the_cycle_draws(h.tr.method, h.tr.roles, h.tr.micro_batches())
        at, pieces = out["at"], out["pieces"]
        assert not _same(at["rollout"], at["critic"]) and not _same(at["critic"], at["actor"])  # each phase draws
        assert torch.equal(rollout_forwards(pieces.run("rollout")[0]), out["result"].rollout_forwards)
        wrong = [replace(mb, stop_gen=None) for mb in pieces.records("rollout")]  # stops from the noise generator
        pieces.run("rollout", records=wrong)
        assert not _same([s[:1] for s in _states(wrong)], [s[:1] for s in at["critic"]])

        # the benchmark's own pieces run
        spans = {name: fn(lambda phase: None) for name, fn in h.standalone().items()}
        assert {"rollout", "critic phase", "critic phase original", "actor step", "scoring", "plain"} <= set(spans)
        assert [s.name for s in steps(h.tr.method.settings)] == ["rollout", "critic", "actor"]


def test_self_forcing_benchmark_pieces_draw_what_the_cycle_draws(tmp_path):
    """The same for Self-Forcing's steps (benchmarks/bench_self_forcing_cycle.py times them alone): the causal
    rollout's exits and windows come from the stop generator, its noise from the rollout generator."""
    from benchmarks import bench_self_forcing_cycle
    with world_of_one():
        a = bench_self_forcing_cycle.parse_args(["--data", "moving-digits", "--micro-batch-size", "1",
                                                 "--dmd2-critic-steps-per-rollout", "2"])
        h = bench_self_forcing_cycle.Harness(a, str(tmp_path))
        at = _pieces_draw_what_the_cycle_draws(h.tr.method, h.tr.roles, h.tr.micro_batches())["at"]
        assert not _same(at["rollout"], at["critic"]) and not _same(at["critic"], at["actor"])


def test_launch_counter_counts_launches_not_views_or_allocations():
    """benchmarks/count_launches.py's counter: a launch each for an add, a matmul and a copy; nothing for a view, a
    reshape of a contiguous result or a bare allocation."""
    from benchmarks.count_launches import OpCounter
    x = torch.randn(4, 6)
    with OpCounter() as c:
        y = x + 1
        y.view(6, 4).t()
        torch.empty(3)
        (x @ x.T).reshape(-1)
        y.clone()
    assert c.total == 3 and dict(c.by_op) == {"add": 1, "mm": 1, "clone": 1}


def test_launch_counter_runs_and_splits_the_cycle_into_its_phases(capsys):
    """benchmarks/count_launches.py at a tiny size: the printed line, and the phases (plus what the trainer does
    around them) add up to the cycle; the CUDA settings' rollout (one forward per step) dispatches fewer ops than the
    CPU's chunks of B rows when the rollout has more than one chunk."""
    from benchmarks import count_launches
    argv = ["--model-size", "debug", "--micro-batch-size", "2", "--path", "eager", "--dmd2-critic-steps-per-rollout",
            "2", "--cycles", "1"]
    with world_of_one():
        cpu = count_launches.main(argv)["eager"]
        cuda = count_launches.main(argv + ["--cuda-settings"])["eager"]
    out = capsys.readouterr().out
    assert re.search(r"aten ops per cycle: [\d,]+ = [\d.]+ plain steps of [\d,]+", out), out
    for r in (cpu, cuda):
        assert list(r["phases"]) == ["rollout", "critic", "actor"] and r["plain"] > 0
        assert abs(sum(r["phases"].values()) + r["outside"] - r["cycle"]) < 1e-6
    assert cuda["phases"]["rollout"] < cpu["phases"]["rollout"] and cuda["phases"]["critic"] == cpu["phases"]["critic"]


def test_profiled_counter_agrees_with_the_dispatch_counter():
    """The GPU path's counter (torch's profiler, which sees inside compiled code) counts eager code as the dispatch
    mode does: composites (`aten::linear`) by the ops they call, views and allocations not at all."""
    from benchmarks.count_launches import OpCounter, ProfiledCounter
    lin, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def step():
        x = torch.randn(4, 8, requires_grad=True)
        y = torch.nn.functional.gelu(lin(norm(x)) * 2 + 1)
        y.view(-1).sum().backward()
        lin.zero_grad(set_to_none=True)
        norm.zero_grad(set_to_none=True)

    step()
    with OpCounter() as dispatch:
        step()
    with ProfiledCounter() as profiled:
        step()
    assert profiled.total == dispatch.total > 10
    assert dict(profiled.by_op) == dict(dispatch.by_op)


def test_launch_counter_gpu_path_compiles_the_blocks(capsys):
    """--path gpu: the blocks compiled (inductor's kernels counted as launches) and the rollout in one forward per
    step; fewer launches per cycle than the eager path's, phases adding up; the count does not depend on what the
    process compiled before (CI's worker had, and counted new rollout shapes' compilations as launches)."""
    from benchmarks import count_launches
    from dmd2_mega.models import compiled
    compiled.reset()
    argv = ["--model-size", "debug", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2", "--cycles", "1"]
    with torch._dynamo.config.patch(disable=False), world_of_one():
        out = count_launches.main(argv)
    gpu, eager = out["gpu"], out["eager"]
    assert compiled.graphs() >= 2
    assert any("cpp_fused" in op for op in gpu["by_op"]), "no inductor kernel was counted"
    assert gpu["cycle"] < eager["cycle"] and gpu["plain"] < eager["plain"]
    assert abs(sum(gpu["phases"].values()) + gpu["outside"] - gpu["cycle"]) < 1e-6
    assert "GPU path / eager path" in capsys.readouterr().out
    with torch._dynamo.config.patch(disable=False), world_of_one():  # again, after this process compiled: the same
        again = count_launches.main(argv + ["--path", "gpu"])["gpu"]
    assert (again["cycle"], again["phases"]) == (gpu["cycle"], gpu["phases"])
    compiled.reset()
