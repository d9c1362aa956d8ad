"""Self-Forcing DMD (issue 30): a causal student trained on its own autoregressive rollouts. `rollout.py`: the
rollout with backward simulation and the actor's replay; `method.py`: the method (--distill-method self-forcing),
DMD2's critic phase and GAN head with its own rollout and actor."""
