"""Time-slicing of roles (DESIGN section 3): put a role's device tensors to sleep and wake them.

A role's tensors are its modules' parameters, their `.grad` and buffers, plus its optimizers'
parameters (fp32 masters under `--bf16`), their `.grad` and state tensors (Adam exp_avg, exp_avg_sq,
step). They are handled per unique STORAGE on the role's device: views that share one storage
(DDP bucket views, grads in a flat buffer) are saved and freed once, and come back with the same
offsets and strides because only the storage's bytes move.

    sleep():  for each storage S of nbytes b:  host_S <- bytes(S)   (pinned CPU buffer on CUDA,
              a separate CPU clone on a CPU-only run, where the "device" is the CPU);
              then S.resize_(0): the device memory is freed, every tensor OBJECT survives, so
              optimizers, hooks and module attributes keep their references.
    wake():   S.resize_(b); bytes(S) <- host_S (non_blocking on CUDA). Bit-exact.

Accounting: `resident_bytes(tensors)` sums nbytes of the unique storages; a sleeping role has 0.

Calls: `sleep()` while asleep and `wake()` while awake are no-ops (the phase table may wake a role
that is already awake). A tensor created after `sleep()` (none should be: the role is idle) is not
restored by `wake()`; a tensor whose storage is already empty (another role asleep) is skipped, so
two roles must not share storage.

While asleep, reading a sleeping tensor is undefined in torch: some ops raise "setStorage ... out
of bounds for storage of size 0", others read freed memory (a segfault on CPU). The entry points
are therefore guarded: a forward of a registered module (a forward-pre-hook) and `step()` of a
registered optimizer raise `RoleAsleepError("role <name> is asleep ...")`. Other reads (printing a
parameter, `state_dict()` for a checkpoint) are not guarded: wake the role first.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor


class RoleAsleepError(RuntimeError):
    """A sleeping role was used (forward or optimizer step) before `wake()`."""


def _unique_storages(tensors: Iterable[Tensor], device: Optional[torch.device] = None) -> list:
    """The distinct non-empty untyped storages of `tensors` (on `device` if given), deduplicated by
    data pointer so that views of one storage count once."""
    seen, out = set(), []
    for t in tensors:
        if device is not None and t.device != device:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(st)
    return out


def resident_bytes(tensors: Iterable[Tensor], device: Optional[torch.device] = None) -> int:
    """Bytes of storage held by `tensors` (unique storages; only those on `device` if given)."""
    return sum(st.nbytes() for st in _unique_storages(tensors, device))


def _bytes_of(storage) -> Tensor:
    """A transient uint8 [nbytes] tensor over a whole storage (never kept across a resize)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _optimizer_tensors(opt) -> list[Tensor]:
    """Params, grads and state tensors of a torch optimizer or a dmd2_mega.optim.Optimizer (whose
    `inner` torch optimizer holds the masters under --bf16; the bf16 model params come from the
    role's modules)."""
    inner = getattr(opt, "inner", opt)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            out += [p] + ([p.grad] if p.grad is not None else [])
    for state in inner.state.values():
        out += [v for v in state.values() if isinstance(v, Tensor)]
    return out


class Sleeper:
    """Sleep / wake of one role's device tensors; see the module docstring.

    name:       the role, for messages ("student", "critic", "teacher").
    modules:    the role's nn.Modules: parameters, their grads and buffers; forwards are guarded.
    optimizers: torch optimizers or dmd2_mega.optim.Optimizer: params, grads, state; step guarded.
    tensors:    further tensors of the role.
    device:     the role's device (default: that of the first parameter / tensor). Only storages on
                it move (e.g. a CPU `step` counter of a CUDA AdamW stays put); on a CPU-only run
                everything is on the CPU and moves.
    """

    def __init__(self, name: str, modules: Sequence[torch.nn.Module] = (), optimizers: Sequence = (),
                 tensors: Sequence[Tensor] = (), device: Optional[torch.device] = None):
        self.name = name
        self.modules, self.optimizers, self.extra = list(modules), list(optimizers), list(tensors)
        if device is None:
            first = next(iter(self.tensors()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._saved: list = []  # (storage, nbytes, host copy) while asleep
        self._asleep = False
        self._handles = [m.register_forward_pre_hook(self._forward_guard) for m in self.modules]
        self._unwrap = []
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Optimizer):
                self._handles.append(opt.register_step_pre_hook(lambda *_: self.check_awake("optimizer step")))
            else:  # a wrapper (dmd2_mega.optim.Optimizer) reads grads before its inner step: guard its step
                self._wrap_step(opt)

    # ---- guards ---------------------------------------------------------------------------------
    def check_awake(self, what: str = "use") -> None:
        if self._asleep:
            raise RoleAsleepError(f"role {self.name} is asleep (its device storage is freed): {what} "
                                  f"needs {self.name}.wake() first")

    def _forward_guard(self, module, args):
        self.check_awake(f"forward of {type(module).__name__}")

    def _wrap_step(self, opt) -> None:
        step = opt.step

        def guarded_step(*args, **kwargs):
            self.check_awake("optimizer step")
            return step(*args, **kwargs)

        opt.step = guarded_step  # instance attribute shadows the method; removed by close()
        self._unwrap.append(opt)

    def close(self) -> None:
        """Remove the guards (the role must be awake)."""
        self.check_awake("close")
        for h in self._handles:
            h.remove()
        for opt in self._unwrap:
            del opt.step
        self._handles, self._unwrap = [], []

    # ---- state ----------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._asleep

    def tensors(self) -> list[Tensor]:
        """The role's tensors now (grads and optimizer state appear lazily, so collected per call)."""
        out = []
        for m in self.modules:
            for p in m.parameters():
                out += [p] + ([p.grad] if p.grad is not None else [])
            out += list(m.buffers())
        for opt in self.optimizers:
            out += _optimizer_tensors(opt)
        return out + self.extra

    def resident_bytes(self) -> int:
        """Device bytes this role holds now (0 while asleep)."""
        return resident_bytes(self.tensors(), self.device)

    def sleep(self) -> int:
        """Copy every storage to the host and free it on the device; returns the bytes freed."""
        if self._asleep:
            return 0
        cuda = self.device.type == "cuda"
        saved = []
        for st in _unique_storages(self.tensors(), self.device):
            src = _bytes_of(st)
            if cuda:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True)
                host.copy_(src, non_blocking=True)
            else:
                host = src.clone()
            saved.append((st, st.nbytes(), host))
            del src
        if cuda:  # host copies complete before any storage is released (side streams included)
            torch.cuda.synchronize(self.device)
        for st, _, _ in saved:
            st.resize_(0)
        self._saved, self._asleep = saved, True
        return sum(n for _, n, _ in saved)

    def wake(self) -> int:
        """Re-allocate every freed storage and copy its bytes back; returns the bytes restored."""
        if not self._asleep:
            return 0
        cuda = self.device.type == "cuda"
        for st, nbytes, host in self._saved:
            st.resize_(nbytes)
            _bytes_of(st).copy_(host, non_blocking=cuda)
        restored = sum(n for _, n, _ in self._saved)
        self._saved, self._asleep = [], False
        return restored
