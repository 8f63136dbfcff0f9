"""The plan: stages, their GPUs, transfers and schedule; every later step reads it.

from ftpipe_compiler.plan import Plan
plan = Plan.load("out/t5-3b/plan.json")

plan.py holds `Plan` (figures and JSON), parts.py its `Stage`, `Transfer` and `PlanParam`,
checks.py what a runnable plan must satisfy (`Plan.validate`).
"""

from .checks import check_plan
from .parts import PlanParam, Stage, Transfer
from .plan import Plan, describe_remat

__all__ = ["Plan", "PlanParam", "Stage", "Transfer", "check_plan", "describe_remat"]
