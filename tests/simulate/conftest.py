"""The simulator tests' fixtures, from sim_plans."""

from sim_plans import contiguous, plan_factory  # noqa: F401
