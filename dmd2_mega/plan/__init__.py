"""Memory and throughput before and during a run: the analytic memory planner (`memory_plan`: roles, phases,
offload and layouts for any family, each family's formulas reached through its `ModelFamily.plan`) and FLOP
accounting (`throughput`)."""
