"""Time-slicing of roles (DESIGN section 3): put a role's device tensors to sleep and wake them.

A role's tensors are its modules' parameters, their `.grad` / fp32 `.main_grad` (grad_buffer) and buffers,
plus its optimizers' parameters (fp32 masters under `--bf16`), their `.grad` and state tensors (Adam exp_avg, exp_avg_sq,
step). They are handled per unique STORAGE on the role's device: views that share one storage
(the main_grad views of one flat GradBuffer) are saved and freed once, and come back with the same
offsets and strides because only the storage's bytes move.

    sleep():  for each storage S of nbytes b:  host_S <- bytes(S)   (host_S: a host buffer made at the
              first sleep and kept, pinned on CUDA: no page-locking per cycle);
              then S.resize_(0): the device memory is freed, every tensor OBJECT survives, so
              optimizers, hooks and module attributes keep their references.
    wake():   S.resize_(b); bytes(S) <- host_S. Bit-exact.
Frozen roles (`frozen=True`: the teacher, whose weights never change): host_S stays valid after the
first sleep, so a later sleep only frees (no device-to-host copy) and a wake is one host-to-device copy.

CUDA: no device-wide synchronisation. Copies run on two side streams per device (device-to-host and
host-to-device, so a waking role's copy can overlap a sleeping role's), ordered by events:
    sleep:  d2h waits for the compute stream (the copy sees the phase's last writes); each storage is
            marked used by d2h (`record_stream`) before it is freed, so the caching allocator hands its
            memory out again only once the copy has read it; an event marks the copies' end.
    wake:   h2d waits for that role's own sleep event (its host buffers are complete) and nothing else,
            allocates and copies; the compute stream waits for h2d before the phase's first kernel, and
            the storages are marked used by the compute stream.
So a wake is queued without the host waiting, and its copy runs while the compute stream still finishes
the previous phase's queued kernels wherever memory allows (the prefetch). Storages allocated by a wake
belong to the h2d stream's pool of the caching allocator; in steady state each role re-uses them.

Parts: a role's storages fall in two parts, slept and woken separately (`set_resident`):
    weights  its modules' parameters and buffers;
    state    everything else: grads, optimizer masters and state, extra tensors (e.g. the student's
             EMA), less any storage the weights part already holds (without --bf16 the optimizer's
             params ARE the module's).
`set_resident("weights")` keeps exactly the weights (the actor phase's frozen critic under the GAN
head); "all" = `wake()`, "none" = `sleep()`.

Experts (`ExpertSleeper`): a frozen role whose model is several experts of which a forward runs some (Wan
2.2's two, `FamilyModel.expert_modules`) has one frozen Sleeper per expert. While a phase needs the role, an
expert wakes in a forward-pre-hook of its own module, after every other expert has been put to sleep, so at most
one expert is resident at a time (a frozen expert's sleep only frees; its wake is one host-to-device copy).

What is not copied (`Role.with_offload` names these for a trained role):
    zeroed   storages that are all zero whenever the role sleeps: its fp32 main_grad buffer (the trainers zero it
             after every optimizer step, and a role sleeps only at a phase boundary, after its step). Freed without
             a copy; a wake re-allocates and zeroes them (a memset, no host-to-device bytes).
    derived  weights the state part determines: a --bf16 role's bf16 parameters are its fp32 masters rounded
             (`optim.Optimizer.copy_to_model`, after every step). Freed without a copy; a wake of the whole role
             wakes the state first and rebuilds them on the device (`derive`). Such a role cannot wake its weights
             alone (a "weights" level), so a role whose phase table asks for that keeps copying them.
So a trained role moves at most 12 bytes per trained parameter each way: its fp32 masters (the fp32 weights
without --bf16) and the two Adam moments, 4 bytes each (plus its `extra` tensors: the student's EMA, 4 more).
Host side: one pinned buffer per part, every storage of the part at an offset in it (allocated at the first sleep
and again only when the part's storages change, e.g. when the optimizer's state first appears).

Accounting: `resident_bytes(tensors)` sums nbytes of the unique storages; a sleeping role has 0. `counters()`: the
copies made and bytes moved so far, per direction (device-to-host, host-to-device), and the bytes zeroed.

Calls: `sleep()` while asleep and `wake()` while awake are no-ops (the phase table may wake a role
that is already awake). A tensor created after `sleep()` (none should be: the role is idle) is not
restored by `wake()`; a tensor whose storage is already empty (another role asleep) is skipped, so
two roles must not share storage.

While asleep, reading a sleeping tensor is undefined in torch: some ops raise "setStorage ... out
of bounds for storage of size 0", others read freed memory (a segfault on CPU). The entry points
are therefore guarded: a forward of a registered module (a forward-pre-hook; needs the weights) and
`step()` of a registered optimizer (needs the state) raise `RoleAsleepError("role <name> is
asleep ...")`. Other reads (printing a parameter, `state_dict()` for a checkpoint) are not guarded:
wake the role first.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional, Sequence

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


_STREAMS: dict = {}


def _side_streams(device: torch.device) -> tuple:
    """(device-to-host, host-to-device) copy streams of a CUDA device, made once."""
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]


def _bytes_of(storage) -> Tensor:
    """A transient uint8 [nbytes] tensor over a whole storage (never kept across a resize)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _optimizer_tensors(opt) -> list[Tensor]:
    """Params, grads and state tensors of a torch optimizer or a dmd2_mega.train.optim.Optimizer (whose
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


def weight_tensors(modules: Sequence[torch.nn.Module]) -> list[Tensor]:
    """A role's weights part: its modules' parameters and buffers."""
    return [t for m in modules for t in list(m.parameters()) + list(m.buffers())]


def state_tensors(modules: Sequence[torch.nn.Module], optimizers: Sequence = (),
                  extra: Sequence[Tensor] = ()) -> list[Tensor]:
    """A role's state part: grads, optimizer tensors, extra tensors (collected per call: grads and
    optimizer state appear lazily)."""
    out = [t for m in modules for p in m.parameters()
           for t in (p.grad, getattr(p, "main_grad", None)) if t is not None]
    for opt in optimizers:
        out += _optimizer_tensors(opt)
    return out + list(extra)


PARTS = ("weights", "state")
LEVELS = {"all": PARTS, "weights": ("weights",), "none": ()}


class Sleeper:
    """Sleep / wake of one role's device tensors; see the module docstring.

    name:       the role, for messages ("student", "critic", "teacher").
    modules:    the role's nn.Modules: parameters and buffers (weights part), grads (state part);
                forwards are guarded.
    optimizers: torch optimizers or dmd2_mega.train.optim.Optimizer: params, grads, state (state part);
                step guarded.
    tensors:    further tensors of the role (state part).
    device:     the role's device (default: that of the first parameter / tensor). Only storages on
                it move (e.g. a CPU `step` counter of a CUDA AdamW stays put); on a CPU-only run
                everything is on the CPU and moves.
    frozen:     the role's tensors never change while it is awake (the teacher): sleeps after the first
                free without copying.
    zeroed:     tensors whose storages are all zero whenever the role sleeps (never copied: module docstring).
    derived, derive: weights whose storages `derive()` rebuilds on the device from the awake state part (never
                copied; both or neither).
    """

    def __init__(self, name: str, modules: Sequence[torch.nn.Module] = (), optimizers: Sequence = (),
                 tensors: Sequence[Tensor] = (), device: Optional[torch.device] = None, frozen: bool = False,
                 zeroed: Sequence[Tensor] = (), derived: Sequence[Tensor] = (),
                 derive: Optional[Callable[[], None]] = None):
        if bool(derived) != (derive is not None):
            raise ValueError("derived tensors and their derive() come together")
        self.name, self.frozen = name, frozen
        self.zeroed, self.derived, self.derive = list(zeroed), list(derived), derive
        self.modules, self.optimizers, self.extra = list(modules), list(optimizers), list(tensors)
        if device is None:
            first = next(iter(self.tensors()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._saved: dict = {}  # part -> [(storage, nbytes, how, host view or None)] while that part sleeps
        self._host: dict = {}   # part -> (layout ((storage key, nbytes), ...), its pinned flat host buffer)
        self._clean: set = set()  # storage keys whose host bytes equal the device bytes (frozen roles)
        self._slept: dict = {}  # part -> CUDA event: the end of that part's device-to-host copies
        self._counts = {"d2h_copies": 0, "d2h_bytes": 0, "h2d_copies": 0, "h2d_bytes": 0, "zeroed_bytes": 0}
        self._handles = [m.register_forward_pre_hook(self._forward_guard) for m in self.modules]
        self._unwrap = []
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Optimizer):
                self._handles.append(opt.register_step_pre_hook(lambda *_: self.check_awake("optimizer step",
                                                                                            "state")))
            else:  # a wrapper (dmd2_mega.train.optim.Optimizer) reads grads before its inner step: guard its step
                self._wrap_step(opt)

    # ---- guards ---------------------------------------------------------------------------------
    def check_awake(self, what: str = "use", part: Optional[str] = None) -> None:
        """Raise RoleAsleepError if `part` (default: any part) is asleep."""
        asleep = [p for p in PARTS if p in self._saved and part in (None, p)]
        if asleep:
            raise RoleAsleepError(f"role {self.name} is asleep (its {' and '.join(asleep)} storage is freed): "
                                  f"{what} needs {self.name}.wake() first")

    def _forward_guard(self, module, args):
        self.check_awake(f"forward of {type(module).__name__}", "weights")

    def _wrap_step(self, opt) -> None:
        step = opt.step

        def guarded_step(*args, **kwargs):
            self.check_awake("optimizer step", "state")
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
        """True when nothing of the role is resident."""
        return all(p in self._saved for p in PARTS)

    @property
    def level(self) -> str:
        """"all", "weights" or "none": what is resident now."""
        return next(k for k, parts in LEVELS.items() if set(parts) == set(PARTS) - set(self._saved))

    def weight_tensors(self) -> list[Tensor]:
        return weight_tensors(self.modules)

    def state_tensors(self) -> list[Tensor]:
        return state_tensors(self.modules, self.optimizers, self.extra)

    def tensors(self) -> list[Tensor]:
        return self.weight_tensors() + self.state_tensors()

    def held(self) -> list[Tensor]:
        """The tensors on the device (a slept storage has 0 bytes there)."""
        return [t for t in self.tensors() if t.device == self.device]

    def resident_bytes(self) -> int:
        """Device bytes this role holds now (0 while asleep)."""
        return resident_bytes(self.held())

    def _storages(self, part: str) -> list:
        weights = _unique_storages(self.weight_tensors(), self.device)
        if part == "weights":
            return weights
        held = {st.data_ptr() for st in weights}
        return [st for st in _unique_storages(self.state_tensors(), self.device) if st.data_ptr() not in held]

    @property
    def copied_bytes(self) -> int:
        """Device <-> host bytes moved so far (both directions)."""
        return self._counts["d2h_bytes"] + self._counts["h2d_bytes"]

    def counters(self) -> dict:
        """Copies made and bytes moved so far per direction, and bytes zeroed on wakes (module docstring)."""
        return dict(self._counts)

    def _how(self, part: str) -> dict:
        """{storage key: "zero" | "derive"} of this part's storages that are not copied."""
        how = {t.untyped_storage()._cdata: "zero" for t in self.zeroed}
        if part == "weights":
            how.update({t.untyped_storage()._cdata: "derive" for t in self.derived})
        return how

    def _host_views(self, part: str, copied: list) -> list:
        """A view of the part's one pinned host buffer per copied storage, in order (a new buffer when the part's
        storages changed since the last sleep)."""
        layout = tuple((st._cdata, st.nbytes()) for st in copied)
        held = self._host.get(part)
        if held is None or held[0] != layout:
            buf = torch.empty(sum(n for _, n in layout), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            held = self._host[part] = (layout, buf)
            self._clean.difference_update(key for key, _ in layout)
        offsets = [0]
        for _, n in layout:
            offsets.append(offsets[-1] + n)
        return [held[1][a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def _sleep_part(self, part: str) -> int:
        if part in self._saved:
            return 0
        storages, how = self._storages(part), self._how(part)
        copied = [st for st in storages if st._cdata not in how]
        hosts = dict(zip((st._cdata for st in copied), self._host_views(part, copied)))
        saved = [(st, st.nbytes(), how.get(st._cdata, "copy"), hosts.get(st._cdata)) for st in storages]
        todo = [(st, hosts[st._cdata]) for st in copied if st._cdata not in self._clean]
        cuda = self.device.type == "cuda"
        if cuda:
            d2h, _ = _side_streams(self.device)
            d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h) if cuda else contextlib.nullcontext():
            for st, host in todo:
                host.copy_(_bytes_of(st), non_blocking=cuda)
        if cuda:
            for st, _ in todo:
                _bytes_of(st).record_stream(d2h)  # its memory is reused only after the copy read it
            self._slept[part] = d2h.record_event()
        self._counts["d2h_copies"] += len(todo)
        self._counts["d2h_bytes"] += sum(st.nbytes() for st, _ in todo)
        if self.frozen:
            self._clean.update(st._cdata for st, _ in todo)
        for st, _, _, _ in saved:
            st.resize_(0)
        self._saved[part] = saved
        return sum(n for _, n, _, _ in saved)

    def _wake_part(self, part: str) -> int:
        saved = self._saved.pop(part, None)
        if saved is None:
            return 0
        if any(how == "derive" for _, _, how, _ in saved) and "state" in self._saved:
            self._saved[part] = saved
            raise ValueError(f"role {self.name}: its weights are derived from its optimizer state, which is asleep: "
                             f"wake the whole role (level 'all'), not its weights alone")
        copies = [(st, nbytes, host) for st, nbytes, how, host in saved if how == "copy"]
        zeros = [(st, nbytes) for st, nbytes, how, _ in saved if how == "zero"]
        cuda = self.device.type == "cuda"
        if cuda:
            _, h2d = _side_streams(self.device)
            if part in self._slept:
                h2d.wait_event(self._slept.pop(part))  # this role's host buffers are complete
        with torch.cuda.stream(h2d) if cuda else contextlib.nullcontext():
            for st, nbytes, _, _ in saved:
                st.resize_(nbytes)
            for st, _, host in copies:
                _bytes_of(st).copy_(host, non_blocking=cuda)
            for st, _ in zeros:
                _bytes_of(st).zero_()
        if cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(h2d)
            for st, _, _, _ in saved:
                _bytes_of(st).record_stream(compute)
        if len(copies) + len(zeros) < len(saved):
            self.derive()  # on the compute stream, which waits for the state's copies
        self._counts["h2d_copies"] += len(copies)
        self._counts["h2d_bytes"] += sum(n for _, n, _ in copies)
        self._counts["zeroed_bytes"] += sum(n for _, n in zeros)
        return sum(n for _, n, _, _ in saved)

    def set_resident(self, level: str) -> int:
        """Make exactly the parts of `level` ("all", "weights", "none") resident; returns the bytes
        moved. The state part sleeps before the weights (it is told apart from them by storage)."""
        if level not in LEVELS:
            raise ValueError(f"residency level must be one of {sorted(LEVELS)}, got {level!r}")
        moved = sum(self._sleep_part(p) for p in reversed(PARTS) if p not in LEVELS[level])
        # derived weights are rebuilt from the state: the state wakes first
        order = reversed(PARTS) if self.derive is not None else PARTS
        return moved + sum(self._wake_part(p) for p in order if p in LEVELS[level])

    def sleep(self) -> int:
        """Copy every storage to the host and free it on the device; returns the bytes freed."""
        return self.set_resident("none")

    def wake(self) -> int:
        """Re-allocate every freed storage and copy its bytes back; returns the bytes restored."""
        return self.set_resident("all")


class ExpertSleeper:
    """Time-slicing of a frozen role of several experts (module docstring, "Experts"); the Sleeper interface the
    roles use: set_resident / sleep / wake / held / resident_bytes / asleep / close / copied_bytes / counters."""

    def __init__(self, name: str, experts: Sequence[torch.nn.Module], device: Optional[torch.device] = None):
        self.name = name
        self.sleepers = [Sleeper(f"{name} (expert {i})", [m], device=device, frozen=True) for i, m in enumerate(experts)]
        self.needed = True  # set_resident: the phase needs the role, its experts wake on demand
        # prepended: runs before the expert's own asleep guard
        self._handles = [m.register_forward_pre_hook(self._enter_hook(i), prepend=True) for i, m in enumerate(experts)]

    def _enter_hook(self, i: int):
        def enter(module, args):
            if self.needed:
                for j, other in enumerate(self.sleepers):
                    if j != i:
                        other.sleep()
                self.sleepers[i].wake()
        return enter

    def set_resident(self, level: str) -> int:
        """"none": every expert sleeps; "all" / "weights": the role is needed, an expert wakes on its forward."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
        self.needed = level != "none"
        return self.sleep() if not self.needed else 0

    def sleep(self) -> int:
        return sum(s.sleep() for s in self.sleepers)

    def wake(self) -> int:
        """Every expert resident (a checkpoint save reads them all)."""
        self.needed = True
        return sum(s.wake() for s in self.sleepers)

    @property
    def asleep(self) -> bool:
        return all(s.asleep for s in self.sleepers)

    @property
    def level(self) -> str:
        """"all" while a phase needs the role (its experts wake on demand), else "none"."""
        return "all" if self.needed else "none"

    @property
    def copied_bytes(self) -> int:
        return sum(s.copied_bytes for s in self.sleepers)

    def counters(self) -> dict:
        per = [s.counters() for s in self.sleepers]
        return {k: sum(c[k] for c in per) for k in per[0]}

    def held(self) -> list[Tensor]:
        return [t for s in self.sleepers for t in s.held()]

    def resident_bytes(self) -> int:
        return sum(s.resident_bytes() for s in self.sleepers)

    def close(self) -> None:
        self.wake()
        for h in self._handles:
            h.remove()
        for s in self.sleepers:
            s.close()
