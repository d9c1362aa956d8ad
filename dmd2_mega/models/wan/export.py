"""The Wan family's export writer: one of our Wan checkpoints -> a diffusers folder WanPipeline runs.

    out/transformer/ (and transformer_2/ for two experts)   WanTransformer3DModel.from_pretrained loads it
    out/scheduler/scheduler_config.json                    the student's few-step sigmas (stochastic sampling)
    out/README.md                                          how to run it in WanPipeline, as written
or, for a LoRA student with --lora-only (`export_lora`), out/pytorch_lora_weights.safetensors (the adapters that
`WanPipeline.load_lora_weights` puts on the transformer of their base: the teacher's, or the student's init
(--student-load), named by path, whose own export the README loads) with the same scheduler/ and README.md.

A causal student (`family.saved_causal`; exported only with --allow-bidirectional-export, `pretrained._export`)
has its chunking in transformer/config.json as `_dmd2_causal` (diffusers' config reader skips "_" keys, so
WanTransformer3DModel.from_pretrained loads it as ever) and a README that says first that WanPipeline runs it with
full attention, not as it was trained, and how to sample it causally (launch/sample.py --stream).

All or nothing (`files/staging.staged_output`): an export that fails or is killed leaves no folder that looks
finished.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from dmd2_mega.errors import CheckpointError
from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.files.staging import staged_output
from dmd2_mega.models.family import causal_words, expected_shapes, pick_weights, saved_causal
from dmd2_mega.models.wan.diffusers import diffusers_name, write_folder
from dmd2_mega.models.wan.experts import EXPERTS

NEW_FOLDER = "export into a new directory"
CAUSAL_KEY = "_dmd2_causal"  # transformer/config.json: a causal student's chunking ("_": diffusers skips it)


def export_diffusers(load: str, out: str, payload: dict, spec, meta, ema: bool, log) -> dict:
    """The folder of the module docstring from a joined (TP=1) payload; `meta`: the model of `spec` on the meta
    device (its parameter names and shapes)."""
    which, state = pick_weights(payload, ema)
    expected = expected_shapes(meta)
    extra = sorted(set(state) - set(expected))
    if extra or set(expected) - set(state):
        raise CheckpointError(f"--load {load}: its weights do not form a Wan transformer of its config "
                              f"(unexpected {extra[:3]}, missing {sorted(set(expected) - set(state))[:3]}); "
                              f"export the student (--save), not the critic")
    prefixes = ("high.", "low.") if spec.boundary_ratio is not None else ("",)
    sigmas, info = payload.get("student_sigmas"), payload.get("data_info") or {}
    form = "concat" if spec.mask_channels else "first-frame" if info.get("cond_parts") else None
    causal = saved_causal(payload)
    text = readme(load, which, sigmas, spec.boundary_ratio is not None, info.get("latent_shape"), image=form,
                  causal=causal)
    extra = None if causal is None else {CAUSAL_KEY: causal_config(causal)}
    with staged_output(out, "--to-diffusers", True, NEW_FOLDER, log) as where:
        for prefix, sub in zip(prefixes, EXPERTS):
            write_folder(os.path.join(where, sub), {n[len(prefix):]: t for n, t in state.items()
                                                    if n.startswith(prefix)}, spec, extra_config=extra)
        write_scheduler(os.path.join(where, "scheduler"), sigmas)
        atomic_write(os.path.join(where, "README.md"), lambda f: f.write(text), text=True)
    log(f"> wrote {out}/transformer ({which} weights of {load}, iteration {payload['iteration']}), "
        f"{out}/scheduler (sigmas {sigmas}) and {out}/README.md")
    return {"weights": which, "sigmas": sigmas, "iteration": payload["iteration"]}


def export_lora(load: str, out: str, payload: dict, spec, ema: bool, log) -> dict:
    """--to-diffusers --lora-only: a LoRA student's adapters (its EMA's unless --no-ema) as the LoRA file
    `WanPipeline.load_lora_weights` loads onto the base pipeline (diffusers' / PEFT's names, written by diffusers'
    own `WanPipeline.save_lora_weights` with rank, alpha and the target modules as its adapter metadata), beside the
    student's scheduler and a README snippet. `payload`: the raw (unmerged) TP=1 payload."""
    meta = payload.get("lora")
    if meta is None:
        raise CheckpointError(f"--lora-only: --load {load} holds full weights, not LoRA adapters (export it "
                              f"without --lora-only)")
    if spec.boundary_ratio is not None:
        raise CheckpointError(f"--lora-only: --load {load} is Wan 2.2's two experts; export the merged folder")
    which = "ema" if ema and "ema" in payload else "model"
    state = {**payload["model"], **(payload["ema"] if which == "ema" else {})}
    layers, modules = {}, set()
    for key, t in state.items():
        if ".lora." not in key:
            raise CheckpointError(f"--lora-only: --load {load} holds {key}, which is not an adapter; export the "
                                  f"student (--save), not the critic")
        prefix, factor = key.rsplit(".lora.", 1)
        module = diffusers_name(prefix + ".inner.weight")[:-len(".weight")]
        modules.add(module)
        layers[f"{module}.lora_{factor}.weight"] = t.float().contiguous()
    sigmas = payload.get("student_sigmas")
    adapter = {"r": meta["rank"], "lora_alpha": meta["alpha"], "target_modules": sorted(modules)}
    d = (payload.get("args") or {}).get("dmd2") or {}
    on_teacher = not d.get("student_load") or d.get("student_load") == d.get("teacher_load")  # as the trainer chose
    text = readme(load, which, sigmas, False, (payload.get("data_info") or {}).get("latent_shape"),
                  lora={**meta, "on_teacher": on_teacher}, causal=saved_causal(payload))
    from diffusers import WanPipeline  # diffusers' writer: its names, its file, its metadata
    with staged_output(out, "--to-diffusers", True, NEW_FOLDER, log) as where:
        WanPipeline.save_lora_weights(where, transformer_lora_layers=layers,
                                      transformer_lora_adapter_metadata=adapter)
        write_scheduler(os.path.join(where, "scheduler"), sigmas)
        atomic_write(os.path.join(where, "README.md"), lambda f: f.write(text), text=True)
    log(f"> wrote {out}/pytorch_lora_weights.safetensors ({which} adapters of {load}, rank {meta['rank']} alpha "
        f"{meta['alpha']:g} on {len(modules)} linears, iteration {payload['iteration']}; base "
        f"{'the teacher ' if on_teacher else 'the student init '}{meta['base']}), "
        f"{out}/scheduler (sigmas {sigmas}) and {out}/README.md")
    return {"weights": which, "sigmas": sigmas, "iteration": payload["iteration"], "modules": len(modules)}


def write_scheduler(folder: str, sigmas: Optional[list]) -> None:
    """FlowMatchEulerDiscreteScheduler with stochastic sampling: each step predicts x0 and re-noises it to the next
    sigma with fresh noise, the DMD2 student's sampler; `sigmas` is the student's schedule (None: a teacher)."""
    cfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
           "use_dynamic_shifting": False, "stochastic_sampling": sigmas is not None}
    if sigmas is not None:
        cfg["_dmd2_student_sigmas"] = [float(s) for s in sigmas]  # "_": diffusers' config reader skips it quietly
    atomic_write(os.path.join(folder, "scheduler_config.json"), lambda f: json.dump(cfg, f, indent=1), text=True)


def causal_config(causal: dict) -> dict:
    """The `_dmd2_causal` entry of a causal student's transformer/config.json."""
    return {**causal, "note": f"a causal student: {causal_words(causal)}; WanTransformer3DModel ignores this key and "
                              f"attends over the whole clip, not as the student was trained"}


def readme(load: str, which: str, sigmas, experts: bool, latent: Optional[list],
           lora: Optional[dict] = None, image: Optional[str] = None, causal: Optional[dict] = None) -> str:
    """How to run the export in WanPipeline, as written on a GPU (bf16) or the CPU (fp32): a student on its own
    sigmas without CFG, a teacher as Wan samples; at the frame count and size of `latent` ([C, T, H, W], the
    checkpoint's data_info; None: not recorded, a converted teacher). Only the folder names are placeholders
    (`tests/test_export_atomic.py` runs it). `lora` (a LoRA student's record, `export_lora`, with "on_teacher"):
    the adapters loaded onto the base pipeline's own transformer (the teacher's), or onto the export of their base
    (the student's init, by path: a third placeholder), in place of an exported transformer. `image` (an
    image-to-video model's form, `image.py`): WanImageToVideoPipeline on a first frame, a placeholder more (the
    first-frame form with the pipeline's expand_timesteps; `tests/test_wan_i2v_export.py` runs it). `causal`
    (`family.saved_causal`): a causal student, said first, that the pipeline runs it with full attention."""
    on_init = lora is not None and not lora["on_teacher"]
    load_t = ("" if lora else 'transformer = WanTransformer3DModel.from_pretrained("<this folder>", '
              'subfolder="transformer", torch_dtype=dtype)\n')
    if on_init:
        load_t = (f"# the adapters sit on the student's init {lora['base']}, not on the teacher: its transformer, "
                  f"exported with\n#   python launch/convert_checkpoint.py --load {lora['base']} --to-diffusers "
                  f"<the base export folder>{' --allow-bidirectional-export' if causal else ''}\n"
                  'base = WanTransformer3DModel.from_pretrained("<the base export folder>", subfolder="transformer", '
                  'torch_dtype=dtype)\n')
    load_t2 = ('transformer_2 = WanTransformer3DModel.from_pretrained("<this folder>", subfolder="transformer_2", '
               'torch_dtype=dtype)\n') if experts else ""
    parts = ("transformer=base, " if on_init else "" if lora else "transformer=transformer, ") + (
        "transformer_2=transformer_2, " if experts else "")
    on = "its init (the base export folder)" if on_init else "the teacher"
    adapters = f'pipe.load_lora_weights("<this folder>")  # the student: its adapters on {on}\n' if lora else ""
    pipeline = "WanImageToVideoPipeline" if image else "WanPipeline"
    if image == "first-frame":  # TI2V: the image is the first latent frame, at timestep 0 (the pipeline's flag)
        parts += "expand_timesteps=True, "
    given = ('image = load_image("<the first frame: an image file>")  # resized to height x width by the pipeline\n'
             if image else "")
    image_arg = "image=image, " if image else ""
    if on_init:
        what = (f"{which} LoRA adapters of rank {lora['rank']}, alpha {lora['alpha']:g}, over the base {lora['base']}:"
                f" the student's init (--student-load), not the teacher; the pipeline must hold that checkpoint's "
                f"transformer, exported to diffusers")
    elif lora:
        what = (f"{which} LoRA adapters of rank {lora['rank']}, alpha {lora['alpha']:g}, over the base "
                f"{lora['base']}; the base pipeline must hold that teacher's transformer")
    else:
        what = f"{which} weights"
    if latent is not None and len(latent) == 4:
        _, t, h, w = (int(n) for n in latent)
        size = (f"# the size it was trained at: latents [T, H, W] = [{t}, {h}, {w}], i.e. (T - 1) * 4 + 1 = {(t - 1) * 4 + 1} "
                f"frames of {8 * h} x {8 * w} with Wan's VAE\n"
                f"num_frames = {t - 1} * pipe.vae_scale_factor_temporal + 1\n"
                f"height, width = {h} * pipe.vae_scale_factor_spatial, {w} * pipe.vae_scale_factor_spatial\n")
        at = ", num_frames=num_frames, height=height, width=width"
    else:
        size = (f"# the size it was trained at is not recorded (converted from a public checkpoint): give num_frames=,\n"
                f"# height= and width= to pipe(...) ({pipeline}'s default is 81 x 480 x 832)\n")
        at = ""
    if causal:
        size += ("# NOT as trained: full attention over the whole clip, where the student attends block-causally over "
                 "chunks\n# (see above)\n")
    if sigmas:
        run = (f"# the student's own sigmas: {pipeline} calls scheduler.set_timesteps(num_inference_steps), which gives\n"
               f"# diffusers' {len(sigmas)}-step grid, not these; without this line it samples at the wrong noise levels\n"
               f"pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, "
               f"sigmas={[float(x) for x in sigmas]})\n{size}"
               f"# {len(sigmas)} steps, no CFG (the student was distilled with the teacher's guidance). Each step predicts x0\n"
               f"# and re-noises it to the next sigma with fresh noise (stochastic_sampling, the student's sampler), which\n"
               f"# {pipeline} draws from torch's global RNG (it passes no generator to scheduler.step): torch.manual_seed,\n"
               f"# not generator=, makes a video repeatable\n"
               f"torch.manual_seed(0)\n"
               f'video = pipe({image_arg}prompt="...", guidance_scale=1.0, num_inference_steps={len(sigmas)}{at})'
               f'.frames[0]\n')
    else:
        run = (f"{size}torch.manual_seed(0)  # the initial noise (no generator=) comes from torch's global RNG\n"
               f'video = pipe({image_arg}prompt="...", num_inference_steps=50, guidance_scale=5.0{at}).frames[0]\n')
    names = ["the two folder names", "the three folder names"][on_init] + (" and the image file" if image else "")
    return (f"# Exported by dmd2-mega from {load} ({what})\n\n" + causal_text(load, causal, bool(lora))
            + f"Replace {names}; the rest runs as written, on a GPU in bf16 or on the CPU in fp32.\n\n"
            f"```python\nimport functools\nimport torch\n"
            f"from diffusers import FlowMatchEulerDiscreteScheduler, {pipeline}, WanTransformer3DModel\n"
            + ("from diffusers.utils import load_image\n" if image else "") + "\n"
            f'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
            f"dtype = torch.bfloat16 if device == \"cuda\" else torch.float32\n"
            f"{load_t}{load_t2}"
            f'scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("<this folder>", subfolder="scheduler")\n'
            f'pipe = {pipeline}.from_pretrained("<the base Wan pipeline folder>", {parts}scheduler=scheduler,\n'
            f"{' ' * (len(pipeline) + 24)}torch_dtype=dtype).to(device)\n{adapters}{given}{run}```\n")


def causal_text(load: str, causal: Optional[dict], lora: bool) -> str:
    """The README's first paragraph for a causal student (nothing for another model)."""
    if causal is None:
        return ""
    cache = (f"; a finished chunk is re-run at noise level {causal['context_noise']:g} to write the KV cache"
             if causal["context_noise"] else "")
    where = ("The chunking is recorded here only (a LoRA file has no model config)." if lora else
             f"transformer/config.json records the chunking as `{CAUSAL_KEY}` (diffusers ignores it), for a causal "
             f"runner of your own.")
    return (f"**Not as trained.** This is a causal student: it generates a video chunk by chunk, "
            f"{causal_words(causal)}{cache}. diffusers has no causal mode: the snippet below runs it in WanPipeline "
            f"with full attention over the whole clip, so every frame sees frames it never saw in training, and its "
            f"videos are not the student's. To sample it as trained, chunk by chunk with its KV cache, use dmd2-mega: "
            f"`python launch/sample.py --load {load} --stream --out DIR` (docs/causal.md). {where}\n\n")
