"""torchrun and the parallel layout: process groups, TP / CP / DP ranks, RNG streams (`parallel`), and
megatron-core's parallel state on a CPU-only torch (`megatron_compat`)."""
