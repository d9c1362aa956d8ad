"""Making `--data` shards and `--eval-prompts` files from media + captions or class folders (`launch/prepare_data.py`).

Modules:
    vae     `LatentVAE` / `VAESpec`: a diffusers VAE folder, pixels in [-1, 1] <-> normalised latents
    text    `TextEncoder`: a UMT5 / T5 encoder folder + tokenizer -> zero-padded embeddings [B, L, D], as WanPipeline
    media   reading videos / GIFs / images, frame sampling, resize + centre crop (or ADM's) -> uint8 [T, H, W, 3]
    clips   the captions file (CSV / JSONL) -> the sorted clip list, checked before any encoding
    image   image-to-video Wan pipelines: the form (concat / first-frame) from the folder's configs, each clip's
            CLIP embedding + image latent after its text (one flat cond, index.json "cond_parts"), --images rows
    folders --labels-from-folders: DIR/<class>/<image> -> class names + the labelled image list (ImageFolder's order)
    writer  the files: resumable shards, index.json, negative.safetensors or classes.json, report.json
    run     `prepare` (torchrun ranks, each encoding its shards) and `prepare_prompts` (--prompts-only)
    trajectories  launch/prepare_trajectories.py: a teacher's Euler paths at the student grid, as resumable shards
Layers: media < clips < folders, writer; vae, text; image (clips, media, vae); run uses them all. Nothing here
imports diffusers or transformers at import time (only when a model folder is loaded).
"""
