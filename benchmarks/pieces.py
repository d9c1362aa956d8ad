"""The steps of a method's cycle run alone, each on exactly what it gets inside the cycle.

    pieces = Pieces(method_steps, roles, batches)   # runs the steps once, in order, as the cycle does
    pieces.run("critic")                             # the critic step alone: same input, same draws, every call

A method's cycle is a sequence of `methods.base.PhaseStep`s, each building every call of its phase (which generator
feeds which draw) from the roles, the micro-batch records and what the step before handed on
(`methods.roles.run_steps` runs them). `Pieces` runs them once in that order, without switching roles (the
benchmarks' roles stay resident), and keeps for each step the micro-batch records at its start (new generators at
their states: `MicroBatch.snapshot`) and what it was given. `run(name)` runs that step on a fresh snapshot of those
records, so a standalone piece consumes every generator exactly as the step does inside the cycle. Nothing here
restates a phase's calls: a benchmark that times a piece times the method's own step.
"""
from __future__ import annotations

from typing import Optional


class Pieces:
    def __init__(self, steps, roles: dict, batches: list):
        self.roles, self.steps = roles, {s.name: s for s in steps}
        self.inputs, self.handed = {}, {}  # {phase: (records at its start, what it was given)}, {phase: its output}
        given = None
        for step in steps:
            self.inputs[step.name] = ([mb.snapshot() for mb in batches], given)
            given, _ = step.run(roles, batches, given)
            self.handed[step.name] = given

    def records(self, name: str) -> list:
        """Fresh copies of the micro-batch records as step `name` starts in the cycle."""
        return [mb.snapshot() for mb in self.inputs[name][0]]

    def run(self, name: str, step=None, records: Optional[list] = None):
        """Step `name` alone (or `step`, another step of that phase: a variant of the method's settings) on
        `records` (default: fresh copies of its start); returns (what it hands on, its metrics)."""
        return (step or self.steps[name]).run(self.roles, records or self.records(name), self.inputs[name][1])
