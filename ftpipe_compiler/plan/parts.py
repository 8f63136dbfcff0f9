"""The parts of a plan: its stages, what crosses between them, and its parameters. They are
the runtime's (ftpipe_runtime.spec.plan), plain frozen data; `Plan` in plan.py holds them and
computes the figures."""

from ftpipe_runtime.spec.plan import PlanParam, Stage, Transfer

__all__ = ["PlanParam", "Stage", "Transfer"]
