"""The plan: stages, their GPUs, transfers and schedule; every later step reads it.

from ftpipe_compiler.plan import Plan
plan = Plan.load("out/t5-3b/plan.json")
"""

from .plan import Plan, PlanParam, Stage, Transfer

__all__ = ["Plan", "PlanParam", "Stage", "Transfer"]
