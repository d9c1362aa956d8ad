"""Initialising a causal student from its teacher's ODE trajectories (`method.CausalInitMethod`)."""
