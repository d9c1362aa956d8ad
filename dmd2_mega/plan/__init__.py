"""Memory and throughput before and during a run: the analytic memory planner (`memory_plan`, the Wan
family's maths in `memory_plan_wan`) and FLOP accounting (`throughput`)."""
