"""Every error type the package raises for bad input or a run it must stop, in one module.

Each message names the flag, file, shard or argument to fix and what was expected. This module
imports nothing from the package, so any layer may raise these. `resilience.run_main` turns the
user-facing ones into one `<ErrorType>: <message>` line and exit code 1. (`dmd2_kernels.KernelError`
lives with the kernels, which import nothing from `dmd2_mega`; `offload.RoleAsleepError` is a
programming error, not bad input.)
"""


class ConfigError(ValueError):
    """A bad flag value; the message names the flag and what was expected."""


class RolloutError(ConfigError):
    """A bad rollout argument (batch, condition shape, micro-batch slice)."""


class DataError(ValueError):
    """A dataset that cannot be used: the message names the flag / file / shard and the mismatch."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or written as asked; the message names the file and the reason."""


class FlowError(ValueError):
    """A bad argument to the flow maths; the message names the argument and what was expected."""


class GridError(ConfigError, FlowError):
    """A bad sigma grid (`--dmd2-student-sigmas`, `--dmd2-denoising-steps`, a grid size)."""


class EvalInputError(ValueError):
    """Bad input to an evaluation function or file; the message names what was expected."""


class NonFiniteError(RuntimeError):
    """A role had too many consecutive optimizer steps with a non-finite loss or gradient norm."""
