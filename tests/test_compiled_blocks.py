"""--compile (`models/compiled.py`): each family's transformer block under torch.compile (inductor, on the CPU here).

  * compiled == eager for tiny DiT, Wan, causal Wan and LoRA-adapted Wan models: the velocity and every parameter's gradient, float32
    within 1e-5 relative (of the largest magnitude), bf16 within bf16's own rounding (a few ulps of the result);
  * compiled blocks under selective recompute == eager blocks without (the checkpoint compiled with the block);
  * the blocks of one model share one graph (a second layer compiles nothing), and a DMD2 run compiles its graphs in
    its first cycle only: two later cycles compile nothing (the recompile test: a new graph after the warm-up fails);
  * the choice: off on a CPU and on with CUDA by default, the layouts that keep eager blocks, the errors of an
    explicit --compile that cannot hold.
"""
import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import BuildOptions, DataShape, build_model, compiled
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan import WanSpec
from dmd2_mega.models.wan.family import WanFamily
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(600)

WAN_SPEC = WanSpec("compile-test", num_heads=2, head_dim=12, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=16, patch_size=(1, 2, 2), rope_max_seq_len=64)


@pytest.fixture(autouse=True)
def compiling():
    """torch.compile on for these tests (the suite's TORCH_COMPILE_DISABLE=1 turns it into a no-op), counts reset."""
    compiled.reset()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False), world_of_one():
        yield
    compiled.reset()


def dit(opts: BuildOptions):
    """The debug DiT through the registry: with compile, its blocks and its regions (the embedding, the final layer)."""
    return build_model("debug", DataShape(4, 8, num_classes=10), options=opts), (
        torch.randn(3, 4, 8, 8), torch.rand(3), torch.randint(0, 10, (3,)))


def wan(opts: BuildOptions):
    m = WanFamily().build(WAN_SPEC, DataShape(4, (3, 4, 6), cond_shape=(3, 16)), options=opts)
    if opts.compile:  # what `registry.build_model` does with BuildOptions(compile=True)
        compiled.compile_blocks(m.transformer_blocks())
    return m, (torch.randn(3, 4, 3, 4, 6), torch.rand(3), torch.randn(3, 3, 16))


def causal_wan(opts: BuildOptions):
    from dataclasses import replace
    m, (x, _, c) = wan(replace(opts, causal=CausalLayout(chunk_frames=1)))
    return m, (x, torch.rand(3, 3), c)  # a level per chunk


def lora_wan(opts: BuildOptions):
    """A Wan with LoRA adapters on its attention and FFN linears (the LoRA roles' models)."""
    from dmd2_mega.models.lora import attach_lora
    m, inputs = wan(opts)
    attach_lora(m, WanFamily.lora_targets, rank=4, alpha=4.0, seed=1)
    return m, inputs


def pair(build, dtype):
    """The same random weights twice: eager blocks, compiled blocks."""
    models = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        m, inputs = build(BuildOptions(compile=compile_))
        with torch.no_grad():
            for p in m.parameters():  # nothing zero-initialised stays zero
                p.add_(0.1 * torch.randn_like(p))
        models.append(m.to(dtype).train())
    return models, tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def run(model, inputs):
    x = inputs[0].clone().requires_grad_(True)
    v = model(x, *inputs[1:])
    (v.float() * torch.linspace(-1, 1, v.numel()).view(v.shape)).sum().backward()
    return [v.detach(), x.grad] + [p.grad for p in model.parameters()]


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


@pytest.mark.parametrize("build", [dit, wan, causal_wan, lora_wan], ids=["dit", "wan", "causal-wan", "lora-wan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_blocks_equal_eager(build, dtype):
    (eager, comp), inputs = pair(build, dtype)
    want, got = run(eager, inputs), run(comp, inputs)
    assert compiled.graphs() >= 1, "nothing was compiled"
    # bf16: the compiled graph fuses elementwise chains in fp32 where eager rounds each op to bf16
    tol = 1e-5 if dtype == torch.float32 else 8 * torch.finfo(torch.bfloat16).eps
    worst = max(rel(g, w) for g, w in zip(got, want) if w is not None)
    assert worst <= tol, f"compiled vs eager: {worst:.2e} relative (tolerance {tol:.1e})"


def test_dit_regions_compiled_with_its_blocks():
    """The DiT names its embedding and final layer as regions (`FamilyModel.region`): one graph each per grad mode,
    shared by every DiT of the process (a second model compiles nothing)."""
    for _ in range(2):
        m, (x, s, c) = dit(BuildOptions(compile=True))
        m(x, s, c).sum().backward()
    assert dict(compiled.GRAPHS) == {"DiTBlock": 1, "DiT_embed": 1, "DiT_final": 1}, dict(compiled.GRAPHS)


def test_kv_cache_streaming_runs_its_blocks_eager():
    """A causal Wan's chunk-by-chunk pass against its KV cache (a stateful mixer) runs the blocks eager: it compiles
    no graph (compiled, each chunk's write flag and positions would be graphs of their own) and equals the eager
    model's pass."""
    (eager, comp), (x, _, c) = pair(causal_wan, torch.float32)
    caches = [m.new_cache() for m in (eager, comp)]
    with torch.no_grad():
        for first, end in eager.causal_layout.chunks(x.shape[2]):
            chunk, level = x[:, :, first:end], torch.full((x.shape[0],), 0.5)
            want, got = (m.stream_forward(chunk, level, c, cache, write=True) for m, cache in zip((eager, comp), caches))
            assert torch.equal(got, want)
    assert compiled.graphs() == 0, dict(compiled.GRAPHS)


@pytest.mark.parametrize("build", [dit, wan], ids=["dit", "wan"])
def test_compiled_selective_recompute_equals_eager(build):
    """--recompute-granularity selective with compiled blocks: the selective checkpoint is compiled with the block
    inside (`recompute.run`; around a compiled block its policy would see no op), one graph for every layer; the
    velocity and every gradient equal the eager model's without recompute (float32 within 1e-5 relative)."""
    models = []
    for opts in (BuildOptions(), BuildOptions(compile=True, recompute="selective")):
        torch.manual_seed(0)
        m, inputs = build(opts)
        with torch.no_grad():
            for p in m.parameters():  # nothing zero-initialised stays zero
                p.add_(0.1 * torch.randn_like(p))
        models.append(m.train())
    want, got = run(models[0], inputs), run(models[1], inputs)
    assert compiled.GRAPHS["SelectiveBlock"] == 1, dict(compiled.GRAPHS)
    worst = max(rel(g, w) for g, w in zip(got, want) if w is not None)
    assert worst <= 1e-5, f"compiled selective vs eager: {worst:.2e} relative"


def test_one_graph_serves_every_layer():
    """A model of 2 blocks and one of 4 compile the same one graph per grad mode: a per-layer compilation fails."""
    from dataclasses import replace
    for layers in (2, 4):
        torch._dynamo.reset()
        compiled.reset()
        m = WanFamily().build(replace(WAN_SPEC, num_layers=layers), DataShape(4, (3, 4, 6), cond_shape=(3, 16)))
        compiled.compile_blocks(m.transformer_blocks())
        x, s, c = torch.randn(3, 4, 3, 4, 6), torch.rand(3), torch.randn(3, 3, 16)
        m(x, s, c).sum().backward()
        with torch.no_grad():
            m(x, s, c)
        assert dict(compiled.GRAPHS) == {"WanBlock": 2}, (layers, dict(compiled.GRAPHS))


def test_no_recompile_after_the_first_cycle(debug_teacher, capsys):
    """A DMD2 run with --compile: its first cycle compiles the blocks' graphs (rollout without grad, critic and actor
    with), and the next two compile nothing and log nothing."""
    from dmd2_mega.arguments import parse_dmd2_args
    from dmd2_mega.methods.dmd2.method import DMD2Trainer
    tr = DMD2Trainer(parse_dmd2_args(["--model-size", "debug", "--teacher-load", debug_teacher, "--compile",
                                      "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
                                      "--train-iters", "3", "--lr", "1e-4", "--log-interval", "100", "--data",
                                      "digits", "--no-offload-inactive"]))
    assert "compile on (--compile)" in capsys.readouterr().out
    tr.cycle()
    first = dict(compiled.GRAPHS)
    assert first.get("DiTBlock", 0) >= 2, first  # the rollout's no-grad graph and the training one at least
    for _ in range(2):
        tr.cycle()
    assert dict(compiled.GRAPHS) == first, f"recompiled after the first cycle: {first} -> {dict(compiled.GRAPHS)}"
    assert "a new graph" not in capsys.readouterr().err


def test_the_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert compiled.choose(None, cpu)[0] is False and "default on a CPU" in compiled.choose(None, cpu)[1]
    assert compiled.choose(None, cuda) == (True, "on (the default on CUDA; --no-compile for eager blocks)")
    assert compiled.choose(True, cpu) == (True, "on (--compile)")
    assert compiled.choose(False, cuda) == (False, "off (--no-compile)")
    on, why = compiled.choose(None, cuda, tp=2)
    assert not on and "TP > 1" in why
    assert not compiled.choose(None, cuda, impl="transformer_engine")[0]
    with pytest.raises(ConfigError, match=r"--compile: TP > 1, CP > 1.*drop --compile"):
        compiled.choose(True, cuda, tp=2, cp=2)
    with pytest.raises(ConfigError, match="--compile: --sequence-parallel"):
        compiled.choose(True, cuda, sp=True)
    with torch._dynamo.config.patch(disable=True):
        assert compiled.choose(None, cuda) == (False, "off (TORCH_COMPILE_DISABLE=1 in the environment)")
        with pytest.raises(ConfigError, match="TORCH_COMPILE_DISABLE=1"):
            compiled.choose(True, cuda)
