"""No output over an input: the one check every entry point runs on its paths before it writes anything.

`check_outputs_apart(outputs, inputs)` takes (flag, path) pairs (a None path: the flag was not given; a third
item says what the path is, shown after it). An output that IS an input, CONTAINS one (a folder the input lies
in) or LIES INSIDE one (a folder the run reads) is a ConfigError naming both flags and both paths, e.g.

    ConfigError: --save-stats R.npz is --ref-stats R.npz, an input of this run: writing it would overwrite that
    input; choose another --save-stats (nothing was written)

Paths are compared after `os.path.realpath` (a symlink, `..` or a relative path does not hide an overlap; an
output that does not exist yet resolves through its existing parents). Only inputs that exist on disk are
compared: a name that is not a path (`--data digits`) cannot be overwritten. Who calls it, with what:
    launch/sample.py          --out                      vs --load, --data, --prompts, --vae
    launch/eval_fid.py        --out, --save-stats        vs --load, --ref-stats, --inception-weights, --vae, --data
    launch/convert_checkpoint --save, --to-diffusers,    vs --from-diffusers, --from-official, --load
                              --to-official
    launch/prepare_data.py    --out                      vs --pipeline, --vae, --text-encoder, --tokenizer,
                                                            --media, --captions, --prompts (prep/run.py)
    the trainers              --save (+ DMD2's critic    vs --data, --eval-prompts, --vae, --load (unless it is
                              directory), --tensorboard-dir   --save: a resume), the DMD2 roles' loads
                                                            (checkpoint_guard.check_save_dirs: a role may load
                                                            from where it saves)
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Tuple

from dmd2_mega.errors import ConfigError

Paths = Iterable[Tuple]  # (flag, path or None) or (flag, path or None, what it is: shown after the path)


def relation(out: str, inp: str) -> Optional[str]:
    """How the path `out` overlaps the path `inp` ("is", "lies inside", "contains"), or None."""
    o, i = os.path.realpath(out), os.path.realpath(inp)
    if o == i:
        return "is"
    if o.startswith(i.rstrip(os.sep) + os.sep):
        return "lies inside"
    if i.startswith(o.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def check_outputs_apart(outputs: Paths, inputs: Paths) -> None:
    """ConfigError for the first output that is, contains or lies inside an existing input (module docstring)."""
    inputs = [entry for entry in inputs if entry[1] and os.path.exists(entry[1])]
    for o_flag, out, *o_what in outputs:
        if not out:
            continue
        for i_flag, inp, *i_what in inputs:
            how = relation(out, inp)
            if how is not None:
                raise ConfigError(f"{o_flag} {out}{_what(o_what)} {how} {i_flag} {inp}{_what(i_what)}, an input of "
                                  f"this run: writing it would overwrite that input; choose another {o_flag} (nothing "
                                  f"was written)")


def _what(note: list) -> str:
    return f" ({note[0]})" if note else ""
