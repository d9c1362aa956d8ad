"""Configuration as small composed dataclasses, validated in `__post_init__`.

`arguments.py` only maps Megatron-style flags onto these (a flag not given leaves its field at the default
here); nothing else reads argparse. Every value is checked here, once, and each check raises `ConfigError`
naming the flag a user would fix. (Checks that need the world size or the built model run where those
exist: `TrainConfig.resolve_batches`, `methods.dmd2.gan.resolve_layer`.)

No flag is a silent no-op: a flag that acts only when another is on (the GAN head's weights need --dmd2-gan)
is a row of its dataclass's `SWITCHED` table (`Needs`: the field, its flag, the switch, how to tell the switch
is on in the composed config); `check_switches` refuses, in one line, any such flag the command line gave,
at any value (its default included), while its switch is off. A flag whose default is "not given" (None or
off) and whose own value check already refuses it without its switch (--dmd2-gan-feature-layer,
--eval-prompts, --vae, --curves-reference, --sequence-parallel) has no row.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional

import torch

from dmd2_mega import flow
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import attention, compiled, recompute
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.family import BuildOptions
from dmd2_mega.models.registry import get_size
from dmd2_mega.files.path_guard import check_outputs_apart


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def saved_section(cls, args: dict, section: str):
    """The `cls` config (a dataclass) that section `section` of a checkpoint's saved `args` records (a checkpoint
    older than a field takes its default; a field it no longer has is left out)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in ((args or {}).get(section) or {}).items() if k in known})


def name_value(text: str, flag: str) -> tuple[str, float]:
    """NAME=VALUE, split at the last "=" (a reference line of the training curves: "teacher 50 steps=1.307") ->
    (NAME, VALUE), or a ConfigError naming `flag` and the form expected."""
    name, sep, value = text.rpartition("=")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    _check(bool(sep and name.strip()) and math.isfinite(number),
           f"{flag} {text!r}: expected NAME=VALUE with a finite number VALUE, e.g. {flag} \"teacher 50 steps=1.307\"")
    return name.strip(), number


def _as_given(flag: str, value) -> str:
    """`flag` with `value` as a command line reads: a switch alone (False: its --no- form), a float in %g, names
    joined by commas, numbers by spaces."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if isinstance(value, (list, tuple)):
        sep = "," if all(isinstance(v, str) for v in value) else " "
        return f"{flag} " + sep.join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


@dataclass(frozen=True)
class Needs:
    """One row of a dataclass's `SWITCHED` table: the flag `flag` (field `field`) acts only when `on(run)` holds
    for the composed config `run` (a `DistillConfig`, a `FlowPretrainConfig`, or the planner's parts);
    `switch` is what to give. Given on the command line while the switch is off, it is `message` (one line)."""

    field: str
    flag: str
    switch: str
    on: Callable[[Any], bool]
    message: str = "{given} has no effect without {switch}: give {switch} or leave the flag out"

    def error(self, value) -> str:
        return self.message.format(given=_as_given(self.flag, value), switch=self.switch)


# The method's parts first: a switch a method needs (--distill-method self-forcing: --causal) is named before the
# flags that need that switch (--causal-chunk-frames).
_CHECK_ORDER = ("dmd2", "gan", "ema", "lora", "model", "parallel", "optim", "train")


def check_switches(run, given) -> None:
    """ConfigError for the first flag of `given` (the (dataclass, field) pairs the command line set: `arguments`)
    that has no effect in `run`: a row of its dataclass's `SWITCHED` whose switch is off (`Needs`)."""
    for name in _CHECK_ORDER:
        part = getattr(run, name, None)
        for need in getattr(part, "SWITCHED", ()):
            if (type(part), need.field) in given and not need.on(run):
                raise ConfigError(need.error(getattr(part, need.field)))


def _teacher_run(run) -> bool:
    """A teacher's pretraining (launch/pretrain_flow.py), not a student's distillation."""
    return isinstance(run, FlowPretrainConfig)


# Switches several rows share: (what to give, whether it is on).
_CAUSAL = ("--causal", lambda run: run.model.causal)
_COSINE = ("--lr-decay-style cosine", lambda run: run.optim.lr_decay_style == "cosine")
_SAVE = ("--save DIR", lambda run: run.train.save is not None)
_LOAD = ("--load DIR", lambda run: run.train.load is not None)
_EVAL = ("--eval-interval N", lambda run: run.train.eval_interval is not None)
_TEACHER = ("launch/pretrain_flow.py", _teacher_run)
_CONSTANT = ("{given} has no effect with --lr-decay-style constant (it shapes the cosine decay): leave it out or "
             "give {switch}")


@dataclass
class ModelConfig:
    """The model: a `--model-size` of the registry (`models/registry.py`: family + spec) and how it runs."""

    size: str = "debug"
    """Registry name: debug (tests), digits (quickstart), 600m, 2b, 8b."""
    attention_backend: str = "sdpa"
    """sdpa (torch's SDPA, its kernel chosen per device), cudnn (SDPA's cuDNN kernel alone), flash3
    (FlashAttention-3) or flash (flash-attn 2): `models/attention.py`."""
    transformer_impl: str = "local"
    """local (megatron-core tensor_parallel linears) or transformer_engine (TE linears)."""
    recompute_granularity: Optional[str] = None
    """--recompute-granularity none | selective | full (`models/recompute.py`): what each block recomputes in
    backward (selective: all but its attention, whose outputs it keeps); None (not given): none in the trainer,
    launch/plan_memory.py chooses per phase."""
    compile: Optional[bool] = None
    """--compile / --no-compile: each transformer block under torch.compile (`models/compiled.py`); None: on with
    CUDA, off on a CPU."""
    causal: bool = False
    """--causal: a causal streaming student (`models/causal.py`): frames in chunks, block-causal attention, a KV
    cache for generation. The weights are the bidirectional model's."""
    causal_chunk_frames: int = 3
    """--causal-chunk-frames: latent frames per chunk (3: Self-Forcing's chunk-wise; 1: frame-wise)."""
    causal_local_attn_chunks: Optional[int] = None
    """--causal-local-attn-chunks W: a chunk attends to the last W chunks only (rolling window); None: all."""
    causal_sink_chunks: int = 0
    """--causal-sink-chunks S: with a window, the first S chunks stay visible (attention sink)."""
    causal_context_noise: float = 0.0
    """--causal-context-noise: the level at which a generated chunk is re-run to write the KV cache (0: clean)."""

    SWITCHED: ClassVar[tuple] = (  # the layout of a causal student: no effect without --causal
        Needs("causal_chunk_frames", "--causal-chunk-frames", *_CAUSAL),
        Needs("causal_local_attn_chunks", "--causal-local-attn-chunks", *_CAUSAL),
        Needs("causal_sink_chunks", "--causal-sink-chunks", *_CAUSAL),
        Needs("causal_context_noise", "--causal-context-noise", *_CAUSAL),
    )

    def __post_init__(self):
        get_size(self.size)  # ConfigError naming --model-size and the choices
        self.causal_layout()  # ConfigError naming the --causal-* flag
        _check(0.0 <= self.causal_context_noise < 1.0,
               f"--causal-context-noise must lie in [0, 1), got {self.causal_context_noise}")
        _check(self.attention_backend in attention.BACKENDS,
               f"--attention-backend must be one of {', '.join(attention.BACKENDS)}, got {self.attention_backend!r}")
        _check(self.transformer_impl in ("local", "transformer_engine"),
               f"--transformer-impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}")
        _check(self.recompute_granularity in (None, *recompute.GRANULARITIES),
               f"--recompute-granularity must be one of {', '.join(recompute.GRANULARITIES)}, got "
               f"{self.recompute_granularity!r}")

    @classmethod
    def saved(cls, args: dict) -> "ModelConfig":
        """The model config a checkpoint's saved `args` record (a checkpoint older than a field takes its default)."""
        return saved_section(cls, args, "model")

    def weights_only(self) -> "ModelConfig":
        """What the weights need of this config (the size and a causal layout), the run-time choices (attention
        backend, linear implementation, recompute) at their defaults: how a sampler rebuilds a saved model."""
        return ModelConfig(self.size, **{f: getattr(self, f) for f in _CAUSAL_FIELDS})

    def causal_layout(self) -> Optional[CausalLayout]:
        """The causal layout of --causal (None without it)."""
        if not self.causal:
            return None
        return CausalLayout(self.causal_chunk_frames, self.causal_local_attn_chunks, self.causal_sink_chunks)

    def options(self) -> BuildOptions:
        return BuildOptions(self.attention_backend, self.transformer_impl, self.recompute_granularity,
                            causal=self.causal_layout())

    def compile_choice(self, device, tp: int = 1, cp: int = 1, sp: bool = False) -> tuple:
        """(compile the blocks?, the start-up line's reason) on this device and layout (`models.compiled.choose`)."""
        return compiled.choose(self.compile, device, tp, cp, sp, self.transformer_impl)

    def attention_choice(self, device, bf16: bool) -> tuple:
        """(backend, the start-up line's words) for this device and compute dtype (`models.attention.choose`)."""
        dtype = torch.bfloat16 if bf16 else torch.float32
        return attention.choose(self.attention_backend, device, dtype, get_size(self.size).spec.head_dim)


_CAUSAL_FIELDS = ("causal", "causal_chunk_frames", "causal_local_attn_chunks", "causal_sink_chunks",
                  "causal_context_noise")


@dataclass
class ParallelConfig:
    """Tensor and context parallel sizes; data parallel size is world_size / (TP x CP)."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size: ranks that split each layer's heads and MLP."""
    context_parallel_size: int = 1
    """--context-parallel-size: ranks that split the token sequence (Ulysses all-to-all in self-attention)."""
    sequence_parallel: bool = False
    """--sequence-parallel: shard the token sequence inside the TP group outside attention and MLP matmuls."""
    distributed_backend: Optional[str] = None
    """None picks nccl on CUDA, gloo on CPU."""

    def __post_init__(self):
        _check(self.tensor_model_parallel_size >= 1,
               f"--tensor-model-parallel-size must be >= 1, got {self.tensor_model_parallel_size}")
        _check(self.context_parallel_size >= 1,
               f"--context-parallel-size must be >= 1, got {self.context_parallel_size}")
        _check(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
               "--sequence-parallel shards the sequence inside the TP group; it needs --tensor-model-parallel-size > 1")
        _check(self.distributed_backend in (None, "nccl", "gloo"),
               f"--distributed-backend must be nccl or gloo, got {self.distributed_backend!r}")


@dataclass
class OptimConfig:
    """AdamW, LR schedule, clipping and precision of one trained role."""

    lr: float = 1e-4
    """--lr: peak learning rate."""
    min_lr: float = 0.0
    """--min-lr: floor of the cosine decay."""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters: linear warmup from 0 to lr."""
    lr_decay_style: str = "cosine"
    """--lr-decay-style: cosine (to min_lr at the last iteration) or constant."""
    lr_decay_iters: Optional[int] = None
    """--lr-decay-iters: defaults to --train-iters."""
    weight_decay: float = 0.0
    """--weight-decay (AdamW, decoupled; not applied to biases, norms and embeddings of size 1-D)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """--clip-grad: global gradient-norm clip across TP and DP; 0 disables."""
    optimizer_impl: str = "torch"
    """--optimizer-impl: torch (AdamW, fused on CUDA) or apex (apex FusedAdam, CUDA only)."""
    bf16: bool = False
    """--bf16: the model's parameters are cast to bf16 (bf16 weights and compute); the optimizer keeps fp32
    master weights and Adam state (not autocast)."""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer: fp32 master weights, reduced gradients and Adam state sharded over the DP group
    (`dist_optim.DistributedOptimizer`); checkpoints stay independent of DP."""
    override_opt_param_scheduler: bool = False
    """--override-opt-param-scheduler: on --load, an LR schedule that differs from the checkpoint's is the flags'."""
    use_checkpoint_opt_param_scheduler: bool = False
    """--use-checkpoint-opt-param-scheduler: on --load, keep the checkpoint's LR schedule over the flags."""

    SWITCHED: ClassVar[tuple] = (
        Needs("min_lr", "--min-lr", *_COSINE, message=_CONSTANT),
        Needs("lr_decay_iters", "--lr-decay-iters", *_COSINE, message=_CONSTANT),
        Needs("override_opt_param_scheduler", "--override-opt-param-scheduler", *_LOAD),
        Needs("use_checkpoint_opt_param_scheduler", "--use-checkpoint-opt-param-scheduler", *_LOAD),
    )

    def scheduler_from(self) -> Optional[str]:
        """Which side wins an LR-schedule mismatch on --load: "flags", "checkpoint" or None (an error)."""
        return ("flags" if self.override_opt_param_scheduler else
                "checkpoint" if self.use_checkpoint_opt_param_scheduler else None)

    def __post_init__(self):
        _check(math.isfinite(self.lr) and self.lr > 0, f"--lr must be a finite number > 0, got {self.lr}")
        _check(self.adam_eps > 0, f"--adam-eps must be > 0, got {self.adam_eps}")
        _check(math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr,
               f"--min-lr must be a finite number in [0, --lr={self.lr}], got {self.min_lr}")
        _check(not (self.use_distributed_optimizer and self.optimizer_impl != "torch"),
               f"--use-distributed-optimizer steps with torch's fused AdamW; --optimizer-impl {self.optimizer_impl} "
               f"is not supported with it")
        _check(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        _check(self.lr_decay_iters is None or self.lr_decay_iters >= 1,
               f"--lr-decay-iters must be >= 1 when given, got {self.lr_decay_iters}")
        _check(self.lr_decay_style in ("cosine", "constant"),
               f"--lr-decay-style must be cosine or constant, got {self.lr_decay_style!r}")
        _check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
               f"--adam-beta1/--adam-beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        _check(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _check(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
               "give at most one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler")
        _check(self.optimizer_impl in ("torch", "apex"),
               f"--optimizer-impl must be torch or apex, got {self.optimizer_impl!r}")


@dataclass
class TrainConfig:
    """Batching, iteration counts, checkpointing, logging and evaluation."""

    data: str = "digits"
    """--data: 'digits' (embedded scikit-learn digits) or a directory of safetensors shards."""
    micro_batch_size: int = 32
    """--micro-batch-size: samples per forward/backward per data-parallel rank."""
    num_workers: int = 2
    """--num-workers: DataLoader worker processes reading shard data (0 = read in the training process)."""
    global_batch_size: Optional[int] = None
    """--global-batch-size: samples per optimizer step over all DP ranks (default micro * DP)."""
    train_iters: int = 1000
    seed: int = 1234
    cond_dropout: float = 0.1
    """--cond-dropout: probability of replacing the condition by the null condition (for CFG)."""
    timestep_shift: float = 1.0
    """--timestep-shift: k of shift(s) = k s / (1 + (k - 1) s), used for training and sampling."""
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    log_interval: int = 10
    eval_interval: Optional[int] = None
    eval_num_samples: int = 500
    """--eval-num-samples: samples drawn for the quality metric at each eval."""
    eval_steps: int = 50
    """--eval-steps: Euler steps of the eval sampler."""
    eval_guidance: float = 1.25
    """--eval-guidance: CFG scale of the eval sampler (1 = no guidance)."""
    eval_prompts: Optional[str] = None
    """--eval-prompts FILE: validation prompt embeddings (`data.prompts`, from prepare_data.py --prompts-only); the
    eval samples one per prompt, named by it, with the file's negative as the teacher's CFG negative."""
    vae: Optional[str] = None
    """--vae DIR: the diffusers VAE folder of latent data (`prep.vae.LatentVAE`); the eval decodes its samples
    and writes them as media (`eval.media`); loaded on the main rank only."""
    tensorboard_dir: Optional[str] = None
    loss_trace: Optional[str] = None
    """--loss-trace: JSON-lines file of every iteration's loss and grad norm (rank 0)."""
    no_load_optim: bool = False
    """--no-load-optim: with --load, take the weights only and start a fresh optimizer and schedule."""
    overwrite_save: bool = False
    """--overwrite-save: write into a --save that holds another run's checkpoints (refused without it, unless --load
    names that folder: a resume); logged at start-up."""
    no_load_rng: bool = False
    deterministic: bool = False
    """--deterministic: torch deterministic algorithms (bitwise-repeatable runs)."""
    exit_signal_handler: bool = False
    """--exit-signal-handler: on SIGTERM, finish the current iteration, save, and exit 0."""
    exit_duration_in_mins: Optional[float] = None
    """--exit-duration-in-mins: save and exit 0 after the first iteration that ends past this wall time."""
    max_nan_iterations: int = 10
    """--max-nan-iterations: stop after this many consecutive skipped (non-finite) steps of one role; 0 = never."""
    curves_reference: Optional[list] = None
    """--curves-reference NAME=VALUE (repeatable): a horizontal line at VALUE, named NAME, on the eval metric's panel
    of <save>/curves.png (`train/curves_plot.py`), e.g. the teacher's Frechet distance "teacher 50 steps=1.307"."""

    SWITCHED: ClassVar[tuple] = (
        Needs("cond_dropout", "--cond-dropout", *_TEACHER,
              message="{given} has no effect in a distillation run: only a teacher's pretraining ({switch}) drops "
                      "the condition; leave the flag out"),
        Needs("save_interval", "--save-interval", *_SAVE),
        Needs("overwrite_save", "--overwrite-save", *_SAVE),
        Needs("no_load_optim", "--no-load-optim", *_LOAD),
        Needs("no_load_rng", "--no-load-rng", *_LOAD),
        Needs("eval_num_samples", "--eval-num-samples", *_EVAL),
        *(Needs(name, flag, *_TEACHER,
                message="{given} has no effect in a distillation run: a student's eval samples its own grid "
                        "(--dmd2-denoising-steps) unguided, only a teacher's ({switch}) reads it; leave the flag out")
          for name, flag in (("eval_steps", "--eval-steps"), ("eval_guidance", "--eval-guidance"))),
        Needs("eval_steps", "--eval-steps", *_EVAL),
        Needs("eval_guidance", "--eval-guidance", *_EVAL),
    )

    def __post_init__(self):
        _check(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _check(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _check(self.global_batch_size is None or self.global_batch_size >= 1,
               f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        _check(self.train_iters >= 0, f"--train-iters must be >= 0, got {self.train_iters}")
        _check(0.0 <= self.cond_dropout < 1.0, f"--cond-dropout must be in [0, 1), got {self.cond_dropout}")
        _check(self.timestep_shift > 0, f"--timestep-shift must be > 0, got {self.timestep_shift}")
        _check(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}")
        for name in ("save_interval", "eval_interval"):
            v = getattr(self, name)
            _check(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        _check(self.eval_interval is None or self.eval_num_samples >= 1,
               f"--eval-num-samples must be >= 1 with --eval-interval {self.eval_interval}, "
               f"got {self.eval_num_samples}")
        _check(self.eval_steps >= 1, f"--eval-steps must be >= 1, got {self.eval_steps}")
        _check(self.eval_guidance >= 1.0, f"--eval-guidance must be >= 1, got {self.eval_guidance}")
        for flag, v in (("--eval-prompts", self.eval_prompts), ("--vae", self.vae)):
            _check(v is None or self.eval_interval is not None,
                   f"{flag} {v} is used by the eval only; give --eval-interval N with it")
        _check(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
               f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins}")
        _check(self.max_nan_iterations >= 0, f"--max-nan-iterations must be >= 0, got {self.max_nan_iterations}")
        self.curve_references()  # ConfigError naming --curves-reference
        _check(not self.curves_reference or bool(self.save and self.eval_interval),
               "--curves-reference is drawn on the eval metric's panel of <save>/curves.png; give --save DIR and "
               "--eval-interval N with it")
        _check(self.loss_trace is None or not os.path.isdir(self.loss_trace),
               f"--loss-trace {self.loss_trace!r} is an existing directory; expected a file path for the JSON lines")
        _check(self.tensorboard_dir is None or not os.path.isfile(self.tensorboard_dir),
               f"--tensorboard-dir {self.tensorboard_dir!r} is an existing file; expected a directory")

    def curve_references(self) -> list[tuple[str, float]]:
        """[(NAME, VALUE)] of --curves-reference."""
        return [name_value(text, "--curves-reference") for text in self.curves_reference or ()]

    def load_is_save(self) -> bool:
        """--load names the folder --save writes (Megatron's resume idiom: `--save D --load D` starts fresh while D
        does not exist yet and resumes once it holds a checkpoint)."""
        return bool(self.load and self.save and os.path.realpath(self.load) == os.path.realpath(self.save))

    def check_paths_apart(self, outputs=(), inputs=()) -> None:
        """`path_guard`: --save, --tensorboard-dir, --loss-trace (and the trainer's `outputs`) never over --data,
        --eval-prompts, --vae, --load (unless --load is --save: a resume) or the trainer's `inputs`."""
        resume = self.load_is_save()
        check_outputs_apart(
            [("--save", self.save), ("--tensorboard-dir", self.tensorboard_dir), ("--loss-trace", self.loss_trace),
             *outputs],
            [("--data", self.data), ("--eval-prompts", self.eval_prompts), ("--vae", self.vae),
             ("--load", None if resume else self.load), *inputs])

    def resolve_batches(self, dp_size: int) -> int:
        """Fill in the global batch and return the number of micro-batches per rank per step."""
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * dp_size
        per_step = self.micro_batch_size * dp_size
        _check(self.global_batch_size % per_step == 0,
               f"--global-batch-size ({self.global_batch_size}) must be a multiple of "
               f"--micro-batch-size x data-parallel size ({self.micro_batch_size} x {dp_size} = {per_step})")
        return self.global_batch_size // per_step


@dataclass
class FlowPretrainConfig:
    """Everything `launch/pretrain_flow.py` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DMD2Config:
    """DMD2 distillation (DESIGN section 2). Roles: student (train), critic (train), teacher (frozen)."""

    teacher_load: Optional[str] = None
    """--teacher-load: teacher checkpoint directory (Megatron layout); required."""
    distill_method: str = "dmd2"
    """--distill-method: dmd2 (a few-step student), or self-forcing (a causal student, --causal, on its own
    autoregressive rollouts: `methods/self_forcing/`)."""
    self_forcing_exit: str = "chunk"
    """--self-forcing-exit: chunk (one exit step per chunk for the whole batch, Self-Forcing's) or sample."""
    self_forcing_rollout_frames: Optional[int] = None
    """--self-forcing-rollout-frames F: self-forcing rolls out F frames and scores a window of the data's T frames
    (Self-Forcing++; default: T)."""
    causal_grad_chunks: Optional[int] = None
    """--causal-grad-chunks M: self-forcing's DMD gradient reaches the last M chunks only (default: all)."""
    student_load: Optional[str] = None
    """--student-load: student init (default: the teacher)."""
    critic_load: Optional[str] = None
    """--critic-load: critic init (default: the teacher)."""
    denoising_steps: Optional[int] = None
    """--dmd2-denoising-steps N: the student's step count (grid (N - i) / N, shifted). Default (None): the
    number of --dmd2-student-sigmas if given, else 4; `__post_init__` fills it in, so it is always an int after."""
    student_sigmas: Optional[list] = None
    """--dmd2-student-sigmas: explicit UNSHIFTED student grid, e.g. 1.0 0.75 0.5 0.25."""
    critic_steps_per_rollout: int = 5
    """--dmd2-critic-steps-per-rollout K (tianweiy/DMD2 dfake_gen_update_ratio)."""
    score_sigma_range: tuple = (0.02, 0.98)
    """--dmd2-score-sigma-range MIN MAX: UNSHIFTED sigma range of the scored (last) critic step."""
    critic_scoring: str = "shared"
    """--dmd2-critic-scoring shared|original (see DESIGN section 2)."""
    critic_loss_space: str = "velocity"
    """--dmd2-critic-loss-space velocity|x0."""
    teacher_guidance_scale: float = 1.0
    """--dmd2-teacher-guidance-scale g >= 1: CFG of the teacher's score (1 = positive only)."""
    critic_grid_size: int = 1000
    """--dmd2-critic-grid-size: points of the critic's sigma grid (unshifted (G - i) / G)."""
    critic_lr: Optional[float] = None
    """--critic-lr (default --lr)."""
    critic_min_lr: Optional[float] = None
    critic_weight_decay: Optional[float] = None
    """--critic-weight-decay (default --weight-decay)."""
    critic_adam_beta1: Optional[float] = None
    critic_adam_beta2: Optional[float] = None
    offload_inactive: Optional[bool] = None
    """--offload-inactive / --no-offload-inactive: every role sleeps in the phases that do not use it / none
    does. Default: on CUDA the memory plan picks the roles that must sleep for every phase to fit
    --gpu-memory-gb (none if all fit); on a CPU none."""
    offload_roles: Optional[tuple] = None
    """--offload-roles ROLE[,ROLE]: only these roles sleep in the phases that do not use them (what
    launch/plan_memory.py --emit-flags writes for a planned subset); instead of --offload-inactive /
    --no-offload-inactive. The names are checked against the method's roles (`offload_set`)."""
    allow_student_teacher: bool = False
    """--allow-student-teacher: accept a student checkpoint as --teacher-load (distilling a distilled model)."""
    gpu_memory_gb: Optional[float] = None
    """--gpu-memory-gb: GiB of device memory the offload plan may use per rank (default: the device's)."""
    cuda_graphs: bool = False
    """--cuda-graphs: each model call of a cycle replayed from a CUDA graph captured once per signature
    (`models/cuda_graphs.py`); CUDA only, not with offload or TP / CP / SP > 1."""
    offload_prefetch: bool = False
    """--offload-prefetch: the next phase's sleeping roles wake during the current phase's last step, their copies
    behind its compute (`methods.roles.ahead`); the roles of both phases are resident meanwhile."""

    SWITCHED: ClassVar[tuple] = (
        Needs("distill_method", "--distill-method", "--causal",
              lambda run: run.dmd2.distill_method != "self-forcing" or run.model.causal,
              message="{given} trains a causal student: give {switch} (and --causal-chunk-frames; --student-load "
                      "the causal init, launch/pretrain_causal_init.py)"),
        *(Needs(name, flag, "--distill-method self-forcing", lambda run: run.dmd2.distill_method == "self-forcing")
          for name, flag in (("self_forcing_exit", "--self-forcing-exit"),
                             ("self_forcing_rollout_frames", "--self-forcing-rollout-frames"),
                             ("causal_grad_chunks", "--causal-grad-chunks"))),
        Needs("offload_prefetch", "--offload-prefetch", "--offload-inactive or --offload-roles",
              lambda run: bool(run.dmd2.offload_inactive) or run.dmd2.offload_roles is not None),
        Needs("critic_min_lr", "--critic-min-lr", *_COSINE, message=_CONSTANT),
        Needs("gpu_memory_gb", "--gpu-memory-gb", "--offload-roles / --[no-]offload-inactive",
              lambda run: run.dmd2.offload_roles is None and run.dmd2.offload_inactive is None,
              message="{given} has no effect with --offload-roles, --offload-inactive or --no-offload-inactive: it "
                      "sizes the memory plan that picks the sleeping roles when none of them says; leave one out"),
    )

    def __post_init__(self):
        _check(self.critic_steps_per_rollout >= 1,
               f"--dmd2-critic-steps-per-rollout must be >= 1, got {self.critic_steps_per_rollout}")
        lo, hi = self.score_sigma_range
        _check(0.0 <= lo < hi <= 1.0, f"--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1, got {lo} {hi}")
        _check(self.critic_scoring in ("shared", "original"),
               f"--dmd2-critic-scoring must be shared or original, got {self.critic_scoring!r}")
        _check(self.critic_loss_space in ("velocity", "x0"),
               f"--dmd2-critic-loss-space must be velocity or x0, got {self.critic_loss_space!r}")
        _check(self.teacher_guidance_scale >= 1.0,
               f"--dmd2-teacher-guidance-scale must be >= 1, got {self.teacher_guidance_scale}")
        _check(self.critic_grid_size >= 2, f"--dmd2-critic-grid-size must be >= 2, got {self.critic_grid_size}")
        _check(self.gpu_memory_gb is None or (math.isfinite(self.gpu_memory_gb) and self.gpu_memory_gb > 0),
               f"--gpu-memory-gb must be a finite number > 0, got {self.gpu_memory_gb}")
        if self.offload_roles is not None:
            self.offload_roles = tuple(self.offload_roles)
            given = ",".join(self.offload_roles)
            _check(all(self.offload_roles) and len(set(self.offload_roles)) == len(self.offload_roles),
                   f"--offload-roles takes distinct role names separated by commas (e.g. critic,teacher), "
                   f"got {given!r}")
            _check(self.offload_inactive is None,
                   f"--offload-roles {given} and --{'' if self.offload_inactive else 'no-'}offload-inactive both "
                   f"say which roles sleep; give one of them")
        _check(self.critic_lr is None or (math.isfinite(self.critic_lr) and self.critic_lr > 0),
               f"--critic-lr must be a finite number > 0, got {self.critic_lr}")
        _check(self.critic_min_lr is None or (math.isfinite(self.critic_min_lr) and self.critic_min_lr >= 0),
               f"--critic-min-lr must be a finite number >= 0, got {self.critic_min_lr}")
        _check(self.critic_weight_decay is None or self.critic_weight_decay >= 0,
               f"--critic-weight-decay must be >= 0, got {self.critic_weight_decay}")
        for flag, v in (("--critic-adam-beta1", self.critic_adam_beta1),
                        ("--critic-adam-beta2", self.critic_adam_beta2)):
            _check(v is None or 0 <= v < 1, f"{flag} must be in [0, 1), got {v}")
        _check(self.distill_method in ("dmd2", "self-forcing"),
               f"--distill-method must be dmd2 or self-forcing, got {self.distill_method!r}")
        _check(self.causal_grad_chunks is None or self.causal_grad_chunks >= 1,
               f"--causal-grad-chunks must be >= 1, got {self.causal_grad_chunks}")
        _check(self.self_forcing_rollout_frames is None or self.self_forcing_rollout_frames >= 1,
               f"--self-forcing-rollout-frames must be >= 1, got {self.self_forcing_rollout_frames}")
        _check(self.self_forcing_exit in ("chunk", "sample"),
               f"--self-forcing-exit must be chunk or sample, got {self.self_forcing_exit!r}")
        _check(self.denoising_steps is None or self.denoising_steps >= 1,
               f"--dmd2-denoising-steps must be an int >= 1, got {self.denoising_steps}")
        self.denoising_steps = self._resolve_denoising_steps()
        flow.student_sigmas(self.denoising_steps, self.student_sigmas)  # GridError naming the flag
        self.score_sigma_range = tuple(self.score_sigma_range)
        g = self.critic_grid_size
        _check(bool(flow.critic_grid(g, 1.0, self.score_sigma_range)[1].any()),
               f"--dmd2-score-sigma-range {lo} {hi} holds no point of the {g}-point critic grid")

    def offload_set(self, roles) -> Optional[frozenset]:
        """The roles of the method's `roles` the flags put to sleep in the phases that do not use them: those of
        --offload-roles, all (--offload-inactive), none (--no-offload-inactive); None when no flag says (the
        trainer's memory plan decides). ConfigError for a name --offload-roles gives that is not one of `roles`."""
        if self.offload_roles is not None:
            unknown = [r for r in self.offload_roles if r not in roles]
            _check(not unknown, f"--offload-roles {','.join(self.offload_roles)}: {', '.join(map(repr, unknown))} "
                                f"is not a role of this method (its roles: {', '.join(roles)})")
            return frozenset(self.offload_roles)
        if self.offload_inactive is None:
            return None
        return frozenset(roles) if self.offload_inactive else frozenset()

    def _resolve_denoising_steps(self) -> int:
        """--dmd2-denoising-steps, or the number of --dmd2-student-sigmas, or 4; both flags must agree."""
        if self.student_sigmas is None:
            return 4 if self.denoising_steps is None else self.denoising_steps
        n = len(self.student_sigmas)
        _check(self.denoising_steps in (None, n),
               f"--dmd2-denoising-steps {self.denoising_steps} disagrees with --dmd2-student-sigmas "
               f"{' '.join(f'{v:g}' for v in self.student_sigmas)} ({n} values); give one of the two flags, "
               f"or as many sigmas as steps")
        return n


@dataclass
class GANConfig:
    """DMD2's GAN head on the critic's features (methods/dmd2/gan.py); off by default."""

    enabled: bool = False
    """--dmd2-gan: train a GAN head on the critic's features; its generator loss joins the actor's."""
    feature_layer: Optional[int] = None
    """--dmd2-gan-feature-layer: critic block feeding the head (default the last one of the first half)."""
    noise: bool = True
    """--dmd2-gan-noise / --no-dmd2-gan-noise: noise the head's inputs to a sigma of the GAN range."""
    sigma_range: Optional[tuple] = None
    """--dmd2-gan-sigma-range MIN MAX: UNSHIFTED range of the head's input noise (default: the score range)."""
    disc_weight: float = 1e-2
    """--dmd2-gan-disc-weight: weight of the discriminator loss in the critic's."""
    gen_weight: float = 3e-3
    """--dmd2-gan-gen-weight: weight of the generator loss in the actor's."""
    fakes: str = "own"
    """--dmd2-gan-fakes own | separate: the head's fakes are the critic forward's own rows whose sigma lies in the GAN
    range (no forward of their own; about range / score range of B) or the x0hat of the step's first R rows (R =
    --dmd2-gan-real-rows, as many fakes as reals) noised apart into the range (tianweiy/DMD2's: in the reals' rows
    of the forward, R more rows through blocks 0..l per step)."""
    head: str = "conv"
    """--dmd2-gan-head conv | mlp: the discriminator head (methods/dmd2/gan_heads.py): strided convolutions over the
    block's token grid (tianweiy/DMD2's form) or the token mean into an MLP (the head before issue 54)."""
    head_lr_mult: float = 1.0
    """--dmd2-gan-head-lr-mult: the head's learning rate as a multiple of the critic's (the head starts from scratch,
    the trunk from the teacher)."""
    head_weight_decay: float = 0.01
    """--dmd2-gan-head-weight-decay: AdamW weight decay of the head's parameters, biases and norms included (the
    default is tianweiy/DMD2's: its guidance model's AdamW, weight_decay=0.01 over all parameters)."""
    head_clip_grad: float = 10.0
    """--dmd2-gan-head-clip-grad: the head's gradients are clipped by their own norm to this, apart from the trunk's
    --clip-grad (0 = no clip; the default is tianweiy/DMD2's max_grad_norm for its guidance model, 10)."""
    real_rows: Optional[int] = None
    """--dmd2-gan-real-rows R: dataset samples the head classifies per critic step, rows [kB, kB + R) of the
    micro-batch's K x B (None: B, so each is seen once per cycle; tianweiy/DMD2 shows its discriminator as many
    reals as fakes). At most B: more would reuse the next step's rows."""

    # The head's settings act only with --dmd2-gan (--dmd2-gan-feature-layer, None unless given, is refused on its
    # value by `__post_init__`); its noise range only while the head's inputs are noised.
    SWITCHED: ClassVar[tuple] = (
        *(Needs(name, flag, "--dmd2-gan", lambda run: run.gan.enabled)
          for name, flag in (("noise", "--dmd2-gan-noise"), ("sigma_range", "--dmd2-gan-sigma-range"),
                             ("disc_weight", "--dmd2-gan-disc-weight"), ("gen_weight", "--dmd2-gan-gen-weight"),
                             ("fakes", "--dmd2-gan-fakes"), ("head", "--dmd2-gan-head"),
                             ("head_lr_mult", "--dmd2-gan-head-lr-mult"),
                             ("head_weight_decay", "--dmd2-gan-head-weight-decay"),
                             ("head_clip_grad", "--dmd2-gan-head-clip-grad"), ("real_rows", "--dmd2-gan-real-rows"))),
        Needs("sigma_range", "--dmd2-gan-sigma-range", "--dmd2-gan-noise", lambda run: run.gan.noise,
              message="{given} has no effect with --no-dmd2-gan-noise (the head's inputs are clean); leave one out"),
        Needs("fakes", "--dmd2-gan-fakes", "--dmd2-gan-noise", lambda run: run.gan.noise,
              message="{given} has no effect with --no-dmd2-gan-noise (the clean fakes run a forward of their own); "
                      "leave one out"),
    )

    def __post_init__(self):
        _check(self.disc_weight >= 0, f"--dmd2-gan-disc-weight must be >= 0, got {self.disc_weight}")
        _check(self.gen_weight >= 0, f"--dmd2-gan-gen-weight must be >= 0, got {self.gen_weight}")
        _check(self.head_lr_mult > 0, f"--dmd2-gan-head-lr-mult must be > 0, got {self.head_lr_mult}")
        _check(self.head_weight_decay >= 0,
               f"--dmd2-gan-head-weight-decay must be >= 0, got {self.head_weight_decay}")
        _check(self.head_clip_grad >= 0, f"--dmd2-gan-head-clip-grad must be >= 0, got {self.head_clip_grad}")
        _check(self.real_rows is None or self.real_rows >= 1,
               f"--dmd2-gan-real-rows must be >= 1, got {self.real_rows}")
        _check(self.enabled or self.head_lr_mult == 1.0, "--dmd2-gan-head-lr-mult needs --dmd2-gan")
        _check(self.enabled or self.head == "conv", "--dmd2-gan-head needs --dmd2-gan")
        _check(self.enabled or self.fakes == "own", "--dmd2-gan-fakes needs --dmd2-gan")
        _check(self.enabled or self.head_weight_decay == 0.01, "--dmd2-gan-head-weight-decay needs --dmd2-gan")
        _check(self.enabled or self.head_clip_grad == 10.0, "--dmd2-gan-head-clip-grad needs --dmd2-gan")
        _check(self.enabled or self.feature_layer is None, "--dmd2-gan-feature-layer needs --dmd2-gan")
        if self.sigma_range is not None:
            self.sigma_range = tuple(self.sigma_range)
            glo, ghi = self.sigma_range
            _check(0.0 <= glo < ghi <= 1.0, f"--dmd2-gan-sigma-range needs 0 <= MIN < MAX <= 1, got {glo} {ghi}")

    def input_range(self, dmd2: DMD2Config) -> tuple:
        """The UNSHIFTED sigma range of the head's input noise: --dmd2-gan-sigma-range, else `dmd2`'s score range."""
        return self.sigma_range or tuple(dmd2.score_sigma_range)


@dataclass
class EMAConfig:
    """Exponential moving average of the student's weights (methods/ema.py); off by default."""

    decay: float = 0.0
    """--ema-decay: student EMA decay in [0, 1) (0 = off)."""
    start_iter: int = 0
    """--ema-start-iter: before this cycle the EMA copies the student."""
    no_ema: bool = False
    """--no-ema: evaluate the raw student weights even when an EMA is kept."""

    SWITCHED: ClassVar[tuple] = tuple(
        Needs(name, flag, "--ema-decay D > 0", lambda run: run.ema.enabled,
              message="{given} has no effect with the EMA off: give {switch} or leave the flag out")
        for name, flag in (("start_iter", "--ema-start-iter"), ("no_ema", "--no-ema")))

    def __post_init__(self):
        _check(0.0 <= self.decay < 1.0, f"--ema-decay must be in [0, 1) (0 = off), got {self.decay}")
        _check(self.start_iter >= 0, f"--ema-start-iter must be >= 0, got {self.start_iter}")

    @property
    def enabled(self) -> bool:
        return self.decay > 0


@dataclass
class LoRAConfig:
    """Low-rank adapters for the trained roles over their frozen base (`models/lora.py`); off by default."""

    student_rank: int = 0
    """--student-lora-rank r: the student is adapters of rank r over its init's frozen weights (0: full weights)."""
    critic_rank: int = 0
    """--critic-lora-rank r: the same for the critic."""
    alpha: Optional[float] = None
    """--lora-alpha: the adapters' scale is alpha / r (default: alpha = r, scale 1)."""
    target_modules: Optional[tuple] = None
    """--lora-target-modules NAME[,NAME]: the family's linears to adapt (default: every one it names)."""
    allow_other_base: bool = False
    """--lora-allow-other-base: resume LoRA adapters over a base with another fingerprint than the one they were
    trained over."""
    no_shared_base: bool = False
    """--no-lora-shared-base: a LoRA role initialised from the teacher keeps its own copy of the base (three
    models' memory; the default shares the teacher's weights)."""

    SWITCHED: ClassVar[tuple] = tuple(
        Needs(name, flag, "--student-lora-rank R or --critic-lora-rank R",
              lambda run: run.lora.student_rank > 0 or run.lora.critic_rank > 0,
              message="{given} has no effect without a LoRA role: give {switch}, or leave the flag out")
        for name, flag in (("alpha", "--lora-alpha"), ("target_modules", "--lora-target-modules"),
                           ("allow_other_base", "--lora-allow-other-base"),
                           ("no_shared_base", "--no-lora-shared-base")))

    def __post_init__(self):
        for flag, r in (("--student-lora-rank", self.student_rank), ("--critic-lora-rank", self.critic_rank)):
            _check(r >= 0, f"{flag} must be >= 0 (0 = full weights), got {r}")
        _check(self.alpha is None or (math.isfinite(self.alpha) and self.alpha > 0),
               f"--lora-alpha must be a finite number > 0, got {self.alpha}")
        if self.target_modules is not None:
            self.target_modules = tuple(self.target_modules)
            _check(all(self.target_modules), f"--lora-target-modules takes names separated by commas, got "
                                             f"{','.join(self.target_modules)!r}")

    def rank(self, role: str) -> int:
        """The adapters' rank of a role (0: full weights; roles other than the student and the critic: 0)."""
        return {"student": self.student_rank, "critic": self.critic_rank}.get(role, 0)


@dataclass
class DistillConfig:
    """Everything `launch/pretrain_dmd2.py` needs; `optim` is the student's (and the critic's defaults)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dmd2: DMD2Config = field(default_factory=DMD2Config)
    gan: GANConfig = field(default_factory=GANConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        _check(self.dmd2.teacher_load is not None, "--teacher-load is required (the trained teacher's checkpoint)")
        d, o = self.dmd2, self.optim
        if d.critic_min_lr is not None:
            critic_lr = o.lr if d.critic_lr is None else d.critic_lr
            _check(d.critic_min_lr <= critic_lr,
                   f"--critic-min-lr must be in [0, critic lr={critic_lr}] (--critic-lr, default --lr), "
                   f"got {d.critic_min_lr}")
        if self.gan.sigma_range is not None:
            n = self.dmd2.critic_grid_size
            glo, ghi = self.gan.sigma_range
            _check(bool(flow.critic_grid(n, 1.0, self.gan.sigma_range)[1].any()),
                   f"--dmd2-gan-sigma-range {glo} {ghi} holds no point of the {n}-point critic grid")

    def gan_sigma_range(self) -> tuple:
        """The UNSHIFTED sigma range of the GAN head's input noise."""
        return self.gan.input_range(self.dmd2)

    def critic_optim(self) -> OptimConfig:
        """The student's optimizer settings with the --critic-* overrides that are set (every other field, a
        new one included, is the student's)."""
        d, o = self.dmd2, self.optim
        lr = o.lr if d.critic_lr is None else d.critic_lr
        given = {"lr": lr, "min_lr": min(o.min_lr, lr) if d.critic_min_lr is None else d.critic_min_lr,
                 "weight_decay": d.critic_weight_decay, "adam_beta1": d.critic_adam_beta1,
                 "adam_beta2": d.critic_adam_beta2}
        return replace(o, **{k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)
