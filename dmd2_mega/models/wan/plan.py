"""The Wan family's per-rank parameter / FLOP / activation maths (`models/wan/model.py`), for plan/memory_plan.py.

Notation: hidden D = heads a x head_dim d, layers N, FFN width F, latent channels C, patch (pt, ph, pw) with
P = pt ph pw, tokens S = (T/pt)(H/ph)(W/pw), text tokens L of width E (text_dim), timestep feature width f,
TP degree t, n samples; weight / activation bytes w = 2 under --bf16 else 4.

Parameters (exact; column-parallel weight [out/t, in] and bias split, row-parallel weight [out, in/t] and
bias whole, the q / k RMSNorm weights [D/t] split like the heads):
    sharded (divided by t):  per block, twice (self- and cross-attention): to_q / to_k / to_v 3 D(D+1),
                             to_out D^2, norm_q / norm_k 2D;  fc1 F(D+1), fc2 D F;  time_proj 6D(D+1)
    replicated:              patch_embedding (CP+1)D, time_embedder (f+1)D + (D+1)D, text_embedder
                             (E+1)D + (D+1)D, proj_out (D+1)CP, final scale_shift_table 2D; per block the
                             two to_out biases and the fc2 bias 3D, scale_shift_table 6D, norm2 2D (when
                             cross_attn_norm)
    image-to-video (`image.py`): the patch embedding reads CPi = in_channels P = (2C + 4) P; Wan 2.1 I2V adds
                             per block add_k_proj / add_v_proj 2D(D+1) and norm_added_k D (sharded) and the
                             CLIP embedder 2Di + Di(Di+1) + (Di+1)D + 2D (replicated) on Li = 257 tokens of
                             width Di; its FLOPs: 2 Li (Di^2 + Di D), and cross-attention on L + Li tokens
    buffer:                  the negative-prompt embedding [L, E] (model dtype)
Forward FLOPs per sample on one TP rank (matmuls, 2 per multiply-add):
    2 S (CP D + D CP) + 2 (f D + D^2) + 2 L (E D + D^2) + 2 D 6D / t
    + N [2 S 4D^2 + 4 S^2 D  +  2 S 2D^2 + 2 L 2D^2 + 4 S L D  +  2 S 2 D F] / t
          self-attention          cross-attention (q / out on S, k / v on L)      FFN
Activations a training forward of n samples keeps for backward, per block (c = 1 with cross_attn_norm, else 0):
    n S D (6w + 4 + 4c)     h, the modulated inputs of attn1 / FFN, the attn1 output (gated), the mid residual
                            (attn2's input: with c its fp32 copy, LayerNorm's input, and the normed input at w),
                            the residual before the FFN; the FFN output is kept in fp32 (the model upcasts it)
    + n S (9D + 2F) w / t   per TP shard: q, k before and after the q/k norm, v and the attention output of
                            self-attention; q before / after the norm and the output of cross-attention;
                            fc1 and GELU outputs
    + n L 3D w / t          cross-attention k before / after the norm, v on the text tokens
    + 4 n S (7 + 2c + 2a/t) + 4 n L + 4 n 6D     fp32 norm statistics, the two attention log-sum-exps,
                            the block's modulation [n, 6, D] (its scale rows saved as views of it) (+ 8D c under
                            --bf16: norm2's weight and bias upcast to fp32)
    outside the blocks:     n (f + 4D) w + n L (E + 3D) w + n S (CP + 2D) w + 8 n S + 8 n D + 4 S d
                            (timestep MLP, text MLP and ctx, patches, final norm and projection input, the final
                            modulation [n, 2, D] that its scale is a view of, rope tables). --recompute-granularity full keeps each block's input n S D w (and the
                            modulation n 6D w once, no rope tables), plus one block's full set while that
                            block is recomputed in backward. selective (`models/recompute.py`) keeps as much plus,
                            per block, each attention call's output and log-sum-exp (self, cross, an I2V Wan's image):
                            2 (3 with the image) x (n S_c D w / t + 4 n S_c a / t); it recomputes the block's FLOPs
                            less the attention cores, N (4 S^2 D + 4 S (L + Li) D) / t (`recompute_flops`).
    An I2V Wan adds per block n Li 3D w / t + 4 n Li (image k / v, norm statistics) + 2 n S D w / t + 4 n S a / t
    (the second attention's output and log-sum-exp, and their sum), and outside n Li (4 Di + 3 Di w + 2 D w + 16)
    (the CLIP embedder): an estimate, measured within 10% (wan-i2v-debug, fp32 and bf16, with and without
    recompute; in fp32 the text and CLIP embedders keep views of the whole flat condition).
    Measured with saved-tensor hooks (tests/test_plan_memory.py: wan-debug fp32 and bf16, with and without
    recompute, TP 1 and 2; a config without cross_attn_norm) the estimate equals the kept bytes: factor 1.00
    (the DiT's ACT_FACTOR of 1.25 is not needed). It assumes SDPA / flash attention (log-sum-exp only, no S^2
    term) and counts the torch path of the fused kernels, which saves what the Triton path saves.
Context / sequence parallelism (`models/token_parallel.py`): with S padded to a multiple of C (x t under SP),
    a CP chunk holds S_c = S / C tokens and a rank S_r = S_c / t under SP (else S_c). The per-token terms above
    count S_r (full width; the column-parallel linears keep their local input and gather it again in backward)
    or S_c (per TP shard: the matmuls see the whole chunk); under CP the padded attention output before its
    all-to-all adds n S_c D w / t. Measured (torchrun, CP=2 and TP=2 + SP, 18 and 75 tokens): within 5%, and
    exact with recompute (block inputs n S_r D w).
SDPA's math path (`score_bytes`, --attention-kernel math in the planner) keeps the softmax probabilities in place
    of the log-sum-exps: n (a/(tC) S^2 + a/t S_c L) scores per block at 4 bytes (6 under --bf16: an fp32 softmax
    and its bf16 copy); measured on CPU: exact in fp32, within 10% in bf16.
A no-grad forward of n samples holds about n L (E + D + 2D/t) w (text embeddings, ctx, cross k / v) plus, per
    token, the largest of: the fp32 residual update (h, its modulated input and the attention / FFN output at
    w, with its fp32 product and sum and, under --bf16, the fp32 copy of h: 3Dw + 4D(2 + [bf16])) and the
    attention (2Dw + 5Dw/t) or FFN (2Dw + 2Fw/t) temporaries. An estimate: not measured by the tests.
KV cache of a causal student (`models/wan/causal.py`, `KVCache`), per layer on one rank, for n samples: a cached
    chunk of f token frames has T = f (H/ph)(W/pw) tokens, T' padded like the sequence (a multiple of C, x t
    under SP: the cache keeps views of the padded all-to-all / gather output; T' = T when the split divides it);
        self-attention   2 n T' (a / (t C)) d w   per chunk held: k and v of this rank's heads over EVERY token
                                                  of the chunk (Ulysses: a CP rank holds a head group, all tokens)
        text             2 n L (a / t) d w        once: cross-attention's k and v (whole text, not split over CP)
    At TP=1, CP=1 in bf16 a token costs 2 D w = 4 D bytes per layer (Wan 2.1 14B: 20 KiB); the per-rank
    self-attention bytes times t C, and the text's times t, give the TP=1 cache (tests/test_plan_kv_cache.py
    checks the formula against `KVCache.nbytes()` of a streamed model).
"""
from __future__ import annotations

import math

from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.family import BuildOptions, PlanMaths
from dmd2_mega.models.wan.causal import check_causal


def _dims(ms):
    s = ms.spec
    return s, s.hidden_size, s.ffn_dim, ms.in_channels * math.prod(s.patch_size), ms.tokens, ms.text_len


def _image(ms) -> tuple:
    """(CPi, Li, Di): the patch embedding's input width (an I2V Wan's in_channels = 2 C + 4 per patch element, else
    C P), the CLIP image tokens and their width (0, 0 without)."""
    s = ms.spec
    return s.in_channels * math.prod(s.patch_size), ms.image_len, s.image_dim or 0


def param_counts(ms) -> dict:
    """{'sharded': total over TP ranks, 'replicated': per rank, 'tensors': parameter tensors, 'buffer'}."""
    s, D, F, CP, _, L = _dims(ms)
    CPi, _, Di = _image(ms)
    image_kv = 2 * D * (D + 1) + D if Di else 0  # cross-attention's add_k_proj, add_v_proj, norm_added_k
    attn_sharded = 3 * D * (D + 1) + D * D + 2 * D
    sharded = s.num_layers * (2 * attn_sharded + image_kv + F * (D + 1) + D * F) + 6 * D * (D + 1)
    per_block = 3 * D + 6 * D + (2 * D if s.cross_attn_norm else 0)
    embedder = 2 * Di + Di * (Di + 1) + (Di + 1) * D + 2 * D if Di else 0  # the CLIP embedder: LN, MLP, LN
    replicated = ((CPi + 1) * D + (s.freq_dim + 1) * D + (D + 1) * D + (s.text_dim + 1) * D + (D + 1) * D
                  + (D + 1) * CP + 2 * D + s.num_layers * per_block + embedder)
    # per block: 2 x (q, k, v, out weights + biases, norm_q, norm_k), fc1 + fc2 (+ biases), table, norm2
    tensors = (15 + s.num_layers * (2 * 10 + 4 + 1 + (2 if s.cross_attn_norm else 0))
               + (8 + 5 * s.num_layers if Di else 0))
    e = max(1, len(s.experts))  # Wan 2.2 A14B: both experts live in every role (each sample runs one of them)
    return {"sharded": e * sharded, "replicated": e * replicated, "tensors": e * tensors, "buffer": e * L * s.text_dim}


def forward_flops(ms, n: int = 1, tp: int = 1) -> int:
    """Matmul FLOPs of one forward of n samples on one TP rank (module docstring)."""
    s, D, F, CP, S, L = _dims(ms)
    CPi, Li, Di = _image(ms)
    out = 2 * S * (CPi * D + D * CP) + 2 * (s.freq_dim * D + D * D) + 2 * L * (s.text_dim * D + D * D)
    out += 2 * D * 6 * D // tp + 2 * Li * (Di * Di + Di * D)
    return n * (out + s.num_layers * _block_flops(ms)[0] // tp)


def _block_flops(ms) -> tuple[int, int]:
    """(one block's forward FLOPs per sample at TP 1, its attention cores': q k^T and the weighted sum of v)."""
    _, D, F, _, S, L = _dims(ms)
    Li = ms.image_len
    core = 4 * S * S * D + 4 * S * (L + Li) * D
    return 2 * S * 4 * D * D + 2 * S * 2 * D * D + 2 * (L + Li) * 2 * D * D + 2 * S * 2 * D * F + core, core


def recompute_flops(ms, n: int, tp: int, selective: bool) -> int:
    """The blocks' forward FLOPs of n samples on one TP rank that a backward runs again: every block's (full), less
    its attention cores (selective, which keeps their outputs)."""
    block, core = _block_flops(ms)
    return n * (ms.spec.num_layers * (block - (core if selective else 0)) // tp)


def tokens_per_rank(ms, tp: int, cp: int, sp: bool) -> tuple[int, int]:
    """(tokens of one CP chunk, tokens of one rank between the matmuls), padding included
    (`models/token_parallel.py`: S padded to a multiple of CP, x TP under SP)."""
    parts = cp * (tp if sp else 1)
    padded = -(-ms.tokens // parts) * parts
    return padded // cp, padded // parts


def score_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    """Per block, what SDPA's math path keeps beyond the fused kernels' log-sum-exps: the softmax probabilities of
    self-attention (its a / (t c) heads over all S tokens) and cross-attention (a / t heads, the CP chunk x L),
    at 4 bytes per score, 6 under --bf16 (an fp32 softmax and its bf16 copy)."""
    s, _, _, _, S, L = _dims(ms)
    Sc, _ = tokens_per_rank(ms, tp, cp, sp)
    heads = s.num_heads // tp
    probs = n * (heads // cp * S * S + heads * Sc * L) * (6 if bf16 else 4)
    return probs - 4 * n * Sc * 2 * heads


def layer_activation_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    s, D, F, _, _, L = _dims(ms)
    Sc, Ss = tokens_per_rank(ms, tp, cp, sp)
    w = 2 if bf16 else 4
    c = 1 if s.cross_attn_norm else 0
    exchanged = n * Sc * D // tp * w if cp > 1 else 0  # CP: the padded attention output before its all-to-all
    _, Li, _ = _image(ms)  # an I2V Wan's image tokens: their k / v, and the second attention's output and lse
    image = n * Li * 3 * D // tp * w + 4 * n * Li + 2 * n * Sc * D // tp * w + 4 * n * Sc * s.num_heads // tp
    return (n * Ss * D * (6 * w + 4 + 4 * c) + n * Sc * (9 * D + 2 * F) // tp * w + exchanged
            + n * L * 3 * D // tp * w + 4 * n * Ss * (7 + 2 * c) + 4 * n * Sc * 2 * s.num_heads // tp
            + 4 * n * L + 4 * n * 6 * D + (8 * D * c if bf16 else 0)  # norm2's weight and bias upcast to fp32
            + (image if Li else 0))


def outside_activation_bytes(ms, n: int, tp: int, bf16: bool, recompute: bool, cp: int = 1, sp: bool = False) -> int:
    s, D, _, CP, S, L = _dims(ms)
    Sc, Ss = tokens_per_rank(ms, tp, cp, sp)
    w = 2 if bf16 else 4
    CPi, Li, Di = _image(ms)
    out = (n * (s.freq_dim + 4 * D) * w + n * L * (s.text_dim + 3 * D) * w + n * Ss * (CPi + 2 * D) * w
           + 8 * n * Ss + 8 * n * D)
    out += n * Li * (4 * Di + 3 * Di * w + 2 * D * w + 16)  # the CLIP embedder: input, MLP, image tokens, LN stats
    return out + (n * 6 * D * w if recompute else 4 * Sc * s.head_dim)


def block_input_bytes(ms, n: int, bf16: bool, tp: int = 1, cp: int = 1, sp: bool = False) -> int:
    return n * tokens_per_rank(ms, tp, cp, sp)[1] * ms.spec.hidden_size * (2 if bf16 else 4)


def nograd_activation_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    _, D, F, _, _, L = _dims(ms)
    Sc, Ss = tokens_per_rank(ms, tp, cp, sp)
    w = 2 if bf16 else 4
    residual = 3 * D * w + 4 * D * (2 + (1 if bf16 else 0))  # on this rank's tokens
    inner = 2 * D * w + max(5 * D, 2 * F) * w // tp  # on the CP chunk (gathered under SP)
    return n * L * (ms.spec.text_dim + D + 2 * D // tp) * w + n * max(Ss * residual, Sc * inner)


def attention_kept_bytes(ms, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    """Per block, what selective recompute keeps beyond the block's input (module docstring)."""
    Sc, _ = tokens_per_rank(ms, tp, cp, sp)
    calls = 3 if ms.image_len else 2
    return calls * (n * Sc * ms.spec.hidden_size // tp * (2 if bf16 else 4) + 4 * n * Sc * ms.spec.num_heads // tp)


def kv_cache_bytes(ms, n: int, frames: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> tuple[int, int]:
    """Per layer on one rank (module docstring): (the self-attention k / v of one cached chunk of `frames` token
    frames, the text's k / v). ConfigError for a spec that cannot be causal (Wan 2.2's two experts)."""
    s, _, _, _, _, L = _dims(ms)
    check_causal(s, BuildOptions(causal=CausalLayout()))
    per_frame = math.prod(side // p for side, p in zip(ms.spatial[1:], s.patch_size[1:]))
    parts = cp * (tp if sp else 1)
    tokens = -(-frames * per_frame // parts) * parts
    w = 2 if bf16 else 4
    return 2 * n * tokens * (s.num_heads // tp // cp) * s.head_dim * w, 2 * n * L * (s.num_heads // tp) * s.head_dim * w


def lora_linears(ms) -> list:
    """The linears LoRA adapters may sit on (`WanFamily.lora_targets`), every layer and expert: (name, "column" |
    "row", in, out): per block q, k, v, out of self- and cross-attention (D -> D) and fc1 (D -> F), fc2 (F -> D)."""
    s, D, F = ms.spec, ms.spec.hidden_size, ms.spec.ffn_dim
    attn = [("to_q", "column", D, D), ("to_k", "column", D, D), ("to_v", "column", D, D), ("to_out", "row", D, D)]
    block = attn + attn + [("fc1", "column", D, F), ("fc2", "row", F, D)]
    return block * s.num_layers * max(1, len(s.experts))


MATHS = PlanMaths(param_counts, forward_flops, layer_activation_bytes, block_input_bytes, outside_activation_bytes,
                  nograd_activation_bytes, score_bytes, kv_cache_bytes, lora_linears, attention_kept_bytes,
                  recompute_flops)
