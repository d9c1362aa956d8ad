"""No silent no-op flags (issue 50, defect 10): a flag that acts only when another is on is a row of its config
dataclass's `SWITCHED` table (`config.Needs`); `config.check_switches` makes it a one-line ConfigError naming the
flag, its value and the switch when the command line gives it (at any value, its default included) with the switch
off. With the switch on it parses. Every entry point that takes the flags: launch/pretrain_flow.py
(`parse_flow_args`), launch/pretrain_dmd2.py and launch/pretrain_causal_init.py (`parse_dmd2_args`), and
launch/plan_memory.py (`memory_plan_configs`). All in-process: nothing here builds a model.
"""
import pytest

from dmd2_mega import config
from dmd2_mega.arguments import dmd2_parser, parse_dmd2_args, parse_flow_args
from dmd2_mega.errors import ConfigError

PARSE = {"flow": parse_flow_args, "dmd2": lambda argv: parse_dmd2_args(["--teacher-load", "t", *argv])}
CONFIGS = (config.ModelConfig, config.ParallelConfig, config.OptimConfig, config.TrainConfig, config.DMD2Config,
           config.GANConfig, config.EMAConfig, config.LoRAConfig)

# ---- the three cases of the issue, as the scripts print them -----------------------------------------------------


@pytest.mark.parametrize("argv, line", [
    (["--lora-target-modules", "to_q,to_k"],
     "ConfigError: --lora-target-modules to_q,to_k has no effect without a LoRA role: give --student-lora-rank R or "
     "--critic-lora-rank R, or leave the flag out"),
    (["--dmd2-gan-disc-weight", "0.5"],
     "ConfigError: --dmd2-gan-disc-weight 0.5 has no effect without --dmd2-gan: give --dmd2-gan or leave the flag out"),
    (["--ema-start-iter", "100"],
     "ConfigError: --ema-start-iter 100 has no effect with the EMA off: give --ema-decay D > 0 or leave the flag out"),
], ids=["lora-target-modules", "dmd2-gan-disc-weight", "ema-start-iter"])
def test_the_issues_flags_exit_1_with_one_line(argv, line, capsys):
    from launch import pretrain_dmd2
    assert pretrain_dmd2.main(["--teacher-load", "t", *argv]) == 1
    assert capsys.readouterr().err == line + "\n"


def test_a_flag_given_at_its_default_is_refused_too():
    """What counts is that the flag was given, not that its value differs from the default (a switch given at
    its default, off, is no row: --distill-method dmd2 parses without --causal)."""
    with pytest.raises(ConfigError, match=r"^--ema-start-iter 0 has no effect with the EMA off"):
        parse_dmd2_args(["--teacher-load", "t", "--ema-decay", "0", "--ema-start-iter", "0"])
    with pytest.raises(ConfigError, match=r"^--dmd2-gan-head-lr-mult 1 has no effect without --dmd2-gan"):
        parse_dmd2_args(["--teacher-load", "t", "--dmd2-gan-head-lr-mult", "1"])
    assert parse_dmd2_args(["--teacher-load", "t", "--distill-method", "dmd2", "--ema-decay", "0"]).ema.decay == 0


# ---- every row of the table --------------------------------------------------------------------------------------

# (dataclass, field, switch) of the row; the flags with the switch off and on, each (parser, argv); what the one-line
# error must say (the flag as given, and the switch).
CASES = [
    (config.ModelConfig, "causal_chunk_frames", "--causal", ("flow", ["--causal-chunk-frames", "3"]),
     ("flow", ["--causal", "--causal-chunk-frames", "3"]), ("--causal-chunk-frames 3 has", "give --causal ")),
    (config.ModelConfig, "causal_local_attn_chunks", "--causal", ("dmd2", ["--causal-local-attn-chunks", "2"]),
     ("dmd2", ["--causal", "--causal-local-attn-chunks", "2"]), ("--causal-local-attn-chunks 2 has", "give --causal ")),
    (config.ModelConfig, "causal_sink_chunks", "--causal", ("flow", ["--causal-sink-chunks", "0"]),
     ("flow", ["--causal", "--causal-local-attn-chunks", "2", "--causal-sink-chunks", "1"]),
     ("--causal-sink-chunks 0 has", "give --causal ")),
    (config.ModelConfig, "causal_context_noise", "--causal", ("dmd2", ["--causal-context-noise", "0.1"]),
     ("dmd2", ["--causal", "--causal-context-noise", "0.1"]), ("--causal-context-noise 0.1 has", "give --causal ")),
    (config.OptimConfig, "min_lr", "--lr-decay-style cosine",
     ("flow", ["--lr-decay-style", "constant", "--min-lr", "1e-5"]), ("flow", ["--min-lr", "1e-5"]),
     ("--min-lr 1e-05 has", "with --lr-decay-style constant")),
    (config.OptimConfig, "lr_decay_iters", "--lr-decay-style cosine",
     ("dmd2", ["--lr-decay-style", "constant", "--lr-decay-iters", "10"]), ("dmd2", ["--lr-decay-iters", "10"]),
     ("--lr-decay-iters 10 has", "with --lr-decay-style constant")),
    (config.OptimConfig, "override_opt_param_scheduler", "--load DIR", ("dmd2", ["--override-opt-param-scheduler"]),
     ("dmd2", ["--override-opt-param-scheduler", "--load", "ck"]), ("--override-opt-param-scheduler has", "--load")),
    (config.OptimConfig, "use_checkpoint_opt_param_scheduler", "--load DIR",
     ("flow", ["--use-checkpoint-opt-param-scheduler"]),
     ("flow", ["--use-checkpoint-opt-param-scheduler", "--load", "ck"]),
     ("--use-checkpoint-opt-param-scheduler has", "--load")),
    (config.TrainConfig, "cond_dropout", "launch/pretrain_flow.py", ("dmd2", ["--cond-dropout", "0.1"]),
     ("flow", ["--cond-dropout", "0.1"]), ("--cond-dropout 0.1 has no effect in a distillation run",
                                          "launch/pretrain_flow.py")),
    (config.TrainConfig, "save_interval", "--save DIR", ("flow", ["--save-interval", "5"]),
     ("flow", ["--save-interval", "5", "--save", "s"]), ("--save-interval 5 has", "give --save")),
    (config.TrainConfig, "overwrite_save", "--save DIR", ("dmd2", ["--overwrite-save"]),
     ("dmd2", ["--overwrite-save", "--save", "s"]), ("--overwrite-save has", "give --save")),
    (config.TrainConfig, "no_load_optim", "--load DIR", ("flow", ["--no-load-optim"]),
     ("flow", ["--no-load-optim", "--load", "ck"]), ("--no-load-optim has", "give --load")),
    (config.TrainConfig, "no_load_rng", "--load DIR", ("dmd2", ["--no-load-rng"]),
     ("dmd2", ["--no-load-rng", "--load", "ck"]), ("--no-load-rng has", "give --load")),
    (config.TrainConfig, "eval_num_samples", "--eval-interval N", ("dmd2", ["--eval-num-samples", "500"]),
     ("dmd2", ["--eval-num-samples", "500", "--eval-interval", "5"]),
     ("--eval-num-samples 500 has", "give --eval-interval")),
    (config.TrainConfig, "eval_steps", "launch/pretrain_flow.py",
     ("dmd2", ["--eval-interval", "5", "--eval-steps", "50"]), ("flow", ["--eval-interval", "5", "--eval-steps", "50"]),
     ("--eval-steps 50 has no effect in a distillation run", "launch/pretrain_flow.py")),
    (config.TrainConfig, "eval_guidance", "launch/pretrain_flow.py",
     ("dmd2", ["--eval-interval", "5", "--eval-guidance", "1.25"]),
     ("flow", ["--eval-interval", "5", "--eval-guidance", "1.25"]),
     ("--eval-guidance 1.25 has no effect in a distillation run", "launch/pretrain_flow.py")),
    (config.TrainConfig, "eval_steps", "--eval-interval N", ("flow", ["--eval-steps", "50"]),
     ("flow", ["--eval-steps", "50", "--eval-interval", "5"]), ("--eval-steps 50 has", "give --eval-interval")),
    (config.TrainConfig, "eval_guidance", "--eval-interval N", ("flow", ["--eval-guidance", "2"]),
     ("flow", ["--eval-guidance", "2", "--eval-interval", "5"]), ("--eval-guidance 2 has", "give --eval-interval")),
    (config.DMD2Config, "distill_method", "--causal", ("dmd2", ["--distill-method", "self-forcing"]),
     ("dmd2", ["--distill-method", "self-forcing", "--causal"]),
     ("--distill-method self-forcing trains a causal student", "give --causal ")),
    (config.DMD2Config, "self_forcing_exit", "--distill-method self-forcing",
     ("dmd2", ["--self-forcing-exit", "chunk"]),
     ("dmd2", ["--self-forcing-exit", "chunk", "--distill-method", "self-forcing", "--causal"]),
     ("--self-forcing-exit chunk has", "give --distill-method self-forcing")),
    (config.DMD2Config, "self_forcing_rollout_frames", "--distill-method self-forcing",
     ("dmd2", ["--self-forcing-rollout-frames", "8"]),
     ("dmd2", ["--self-forcing-rollout-frames", "8", "--distill-method", "self-forcing", "--causal"]),
     ("--self-forcing-rollout-frames 8 has", "give --distill-method self-forcing")),
    (config.DMD2Config, "causal_grad_chunks", "--distill-method self-forcing", ("dmd2", ["--causal-grad-chunks", "1"]),
     ("dmd2", ["--causal-grad-chunks", "1", "--distill-method", "self-forcing", "--causal"]),
     ("--causal-grad-chunks 1 has", "give --distill-method self-forcing")),
    (config.DMD2Config, "critic_min_lr", "--lr-decay-style cosine",
     ("dmd2", ["--lr-decay-style", "constant", "--critic-min-lr", "0"]), ("dmd2", ["--critic-min-lr", "0"]),
     ("--critic-min-lr 0 has", "with --lr-decay-style constant")),
    (config.DMD2Config, "gpu_memory_gb", "--offload-roles / --[no-]offload-inactive",
     ("dmd2", ["--offload-roles", "critic", "--gpu-memory-gb", "40"]), ("dmd2", ["--gpu-memory-gb", "40"]),
     ("--gpu-memory-gb 40 has", "--offload-roles")),
    (config.GANConfig, "noise", "--dmd2-gan", ("dmd2", ["--no-dmd2-gan-noise"]),
     ("dmd2", ["--no-dmd2-gan-noise", "--dmd2-gan"]), ("--no-dmd2-gan-noise has", "give --dmd2-gan ")),
    (config.GANConfig, "sigma_range", "--dmd2-gan", ("dmd2", ["--dmd2-gan-sigma-range", "0.05", "0.3"]),
     ("dmd2", ["--dmd2-gan-sigma-range", "0.05", "0.3", "--dmd2-gan"]),
     ("--dmd2-gan-sigma-range 0.05 0.3 has", "give --dmd2-gan ")),
    (config.GANConfig, "disc_weight", "--dmd2-gan", ("dmd2", ["--dmd2-gan-disc-weight", "0.5"]),
     ("dmd2", ["--dmd2-gan-disc-weight", "0.5", "--dmd2-gan"]), ("--dmd2-gan-disc-weight 0.5 has", "give --dmd2-gan ")),
    (config.GANConfig, "gen_weight", "--dmd2-gan", ("dmd2", ["--dmd2-gan-gen-weight", "3e-3"]),
     ("dmd2", ["--dmd2-gan-gen-weight", "3e-3", "--dmd2-gan"]),
     ("--dmd2-gan-gen-weight 0.003 has", "give --dmd2-gan ")),
    (config.GANConfig, "real_rows", "--dmd2-gan", ("dmd2", ["--dmd2-gan-real-rows", "2"]),
     ("dmd2", ["--dmd2-gan-real-rows", "2", "--dmd2-gan"]), ("--dmd2-gan-real-rows 2 has", "give --dmd2-gan ")),
    (config.GANConfig, "fakes", "--dmd2-gan", ("dmd2", ["--dmd2-gan-fakes", "own"]),
     ("dmd2", ["--dmd2-gan-fakes", "own", "--dmd2-gan"]), ("--dmd2-gan-fakes own has", "give --dmd2-gan ")),
    (config.GANConfig, "head", "--dmd2-gan", ("dmd2", ["--dmd2-gan-head", "conv"]),
     ("dmd2", ["--dmd2-gan-head", "conv", "--dmd2-gan"]), ("--dmd2-gan-head conv has", "give --dmd2-gan ")),
    (config.GANConfig, "head_lr_mult", "--dmd2-gan", ("dmd2", ["--dmd2-gan-head-lr-mult", "1"]),
     ("dmd2", ["--dmd2-gan-head-lr-mult", "1", "--dmd2-gan"]), ("--dmd2-gan-head-lr-mult 1 has", "give --dmd2-gan ")),
    (config.GANConfig, "head_weight_decay", "--dmd2-gan", ("dmd2", ["--dmd2-gan-head-weight-decay", "0.01"]),
     ("dmd2", ["--dmd2-gan-head-weight-decay", "0.01", "--dmd2-gan"]),
     ("--dmd2-gan-head-weight-decay 0.01 has", "give --dmd2-gan ")),
    (config.GANConfig, "head_clip_grad", "--dmd2-gan", ("dmd2", ["--dmd2-gan-head-clip-grad", "10"]),
     ("dmd2", ["--dmd2-gan-head-clip-grad", "10", "--dmd2-gan"]),
     ("--dmd2-gan-head-clip-grad 10 has", "give --dmd2-gan ")),
    (config.GANConfig, "sigma_range", "--dmd2-gan-noise",
     ("dmd2", ["--dmd2-gan", "--no-dmd2-gan-noise", "--dmd2-gan-sigma-range", "0.05", "0.3"]),
     ("dmd2", ["--dmd2-gan", "--dmd2-gan-noise", "--dmd2-gan-sigma-range", "0.05", "0.3"]),
     ("--dmd2-gan-sigma-range 0.05 0.3 has", "with --no-dmd2-gan-noise")),
    (config.GANConfig, "fakes", "--dmd2-gan-noise",
     ("dmd2", ["--dmd2-gan", "--no-dmd2-gan-noise", "--dmd2-gan-fakes", "separate"]),
     ("dmd2", ["--dmd2-gan", "--dmd2-gan-noise", "--dmd2-gan-fakes", "separate"]),
     ("--dmd2-gan-fakes separate has", "with --no-dmd2-gan-noise")),
    (config.DMD2Config, "offload_prefetch", "--offload-inactive or --offload-roles", ("dmd2", ["--offload-prefetch"]),
     ("dmd2", ["--offload-prefetch", "--offload-roles", "critic"]),
     ("--offload-prefetch has", "give --offload-inactive or --offload-roles")),
    (config.EMAConfig, "start_iter", "--ema-decay D > 0", ("dmd2", ["--ema-start-iter", "100"]),
     ("dmd2", ["--ema-start-iter", "100", "--ema-decay", "0.9"]), ("--ema-start-iter 100 has", "give --ema-decay")),
    (config.EMAConfig, "no_ema", "--ema-decay D > 0", ("dmd2", ["--ema-decay", "0", "--no-ema"]),
     ("dmd2", ["--ema-decay", "0.9", "--no-ema"]), ("--no-ema has", "give --ema-decay")),
    (config.LoRAConfig, "alpha", "--student-lora-rank R or --critic-lora-rank R", ("dmd2", ["--lora-alpha", "8"]),
     ("dmd2", ["--lora-alpha", "8", "--critic-lora-rank", "4"]), ("--lora-alpha 8 has", "--student-lora-rank")),
    (config.LoRAConfig, "target_modules", "--student-lora-rank R or --critic-lora-rank R",
     ("dmd2", ["--lora-target-modules", "to_q,to_k"]),
     ("dmd2", ["--lora-target-modules", "to_q,to_k", "--student-lora-rank", "4"]),
     ("--lora-target-modules to_q,to_k has", "--student-lora-rank")),
    (config.LoRAConfig, "allow_other_base", "--student-lora-rank R or --critic-lora-rank R",
     ("dmd2", ["--lora-allow-other-base"]), ("dmd2", ["--lora-allow-other-base", "--student-lora-rank", "4"]),
     ("--lora-allow-other-base has", "--student-lora-rank")),
    (config.LoRAConfig, "no_shared_base", "--student-lora-rank R or --critic-lora-rank R",
     ("dmd2", ["--no-lora-shared-base"]), ("dmd2", ["--no-lora-shared-base", "--critic-lora-rank", "4"]),
     ("--no-lora-shared-base has", "--student-lora-rank")),
]


def _rows() -> set:
    return {(cls, need.field, need.switch) for cls in CONFIGS for need in getattr(cls, "SWITCHED", ())}


def test_the_cases_cover_every_row_and_each_row_names_its_fields_flag():
    """A new row without a case here fails; a row's flag is the one `arguments` maps onto its field."""
    assert {case[:3] for case in CASES} == _rows()
    actions = dmd2_parser()._option_string_actions
    for cls in CONFIGS:
        for need in getattr(cls, "SWITCHED", ()):
            assert actions[need.flag].dest == f"{cls.__name__}.{need.field}", need.flag


@pytest.mark.parametrize("cls, field, switch, off, on, says", CASES,
                         ids=[f"{c[0].__name__}.{c[1]}-{c[2].split()[0]}" for c in CASES])
def test_a_flag_with_its_switch_off_is_one_line_naming_both(cls, field, switch, off, on, says):
    with pytest.raises(ConfigError) as e:
        PARSE[off[0]](off[1])
    message = str(e.value)
    assert "\n" not in message and all(s in message for s in says), message
    PARSE[on[0]](on[1])  # the switch on: the same flag parses


# ---- the planner shares the trainer's flags, and so their check ---------------------------------------------------

def test_the_planner_refuses_what_the_trainer_refuses():
    from launch import plan_memory
    argv = ["--causal-chunk-frames", "2"]
    with pytest.raises(ConfigError) as trainer:
        parse_dmd2_args(["--teacher-load", "t", *argv])
    with pytest.raises(ConfigError) as planner:
        plan_memory.parse_args(argv)
    assert str(planner.value) == str(trainer.value) == \
        "--causal-chunk-frames 2 has no effect without --causal: give --causal or leave the flag out"
    assert plan_memory.parse_args(["--causal", *argv]).run.model.causal_chunk_frames == 2
    assert plan_memory.parse_args(["--gpu-memory-gb", "40"]).gpu_memory_gb == 40  # no offload flag: the plan reads it


@pytest.mark.parametrize("flag", [["--dmd2-gan"], ["--dmd2-teacher-guidance-scale", "2"], ["--critic-lr", "1e-4"],
                                  ["--critic-lora-rank", "2"], ["--distill-method", "dmd2"]])
def test_the_causal_init_refuses_the_flags_its_method_never_reads(flag, capsys):
    """launch/pretrain_causal_init.py shares pretrain_dmd2.py's parser; the critic's, the teacher score's, the GAN
    head's and the other methods' flags never act there (`CausalInitMethod.unread`)."""
    from launch import pretrain_causal_init
    args = ["--model-size", "wan-digits", "--causal", "--teacher-load", "t", "--data", "d"]
    assert pretrain_causal_init.main(args + flag) == 1
    assert capsys.readouterr().err.strip() == (f"ConfigError: {flag[0]} has no effect in "
                                                "launch/pretrain_causal_init.py: its method never reads it; leave the "
                                                "flag out")
    from dmd2_mega.arguments import parse_dmd2_args
    from dmd2_mega.methods.causal_init.method import CausalInitMethod
    cfg = parse_dmd2_args(args + ["--student-lora-rank", "2", "--ema-decay", "0.9"], CausalInitMethod.unread)
    assert cfg.lora.student_rank == 2  # what it reads still parses
