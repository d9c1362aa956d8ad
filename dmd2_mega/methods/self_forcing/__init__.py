"""Self-Forcing DMD (issue 30): a causal student trained on its own autoregressive rollouts. So far: the rollout
(`rollout.py`); the method (critic and actor phases over the shared roles) is to come."""
