"""Frozen parameters at run time: which stages need no backward.

    forward_only_stages(topo, modules)        # {0}: stages that run forwards only

A frozen weight is an `nn.Parameter` with `requires_grad` False (`StageModule.FROZEN`): it
gets no gradient, no optimizer state (optimizers are built from the trainable ones), no
all-reduce among replicas (`replicas.GradSync` sums trainable ones). Frozen at compile time,
it is not written into checkpoints (`precision.MixedPrecision.state_dict`): a run rebuilds
it the way it built it at the start (the model's folder, the seeded initial values, or
--init). Weights frozen mid-run (freeze training, `freezing.Freezer` through
`MixedPrecision.freeze`) trained before, so checkpoints keep them.

A stage is forward-only when nothing it holds trains and no gradient crosses its borders
(neither a received tensor nor a sent one carries one, per the plan's transfers): its
forwards run without autograd and keep nothing, and its B and W actions are no-ops. The
schedule keeps them (a schedule is data about the order of work on a GPU; a no-op B costs
nothing and every schedule, the validator and CSV schedules stay as they are whatever is
frozen), and the simulator gives them zero time, as the plan's costs say.
"""

from __future__ import annotations

__all__ = ["forward_only_stages"]


def forward_only_stages(topo, modules: dict) -> set[int]:
    """This rank's stages that need no backward (see the module doc)."""
    out = set()
    for s, module in modules.items():
        borders = (*topo.inputs[s], *topo.outputs[s])
        grads = any(topo.transfers[t].grad for t in borders if t in topo.transfers)
        trains = any(p.requires_grad for p in module.parameters())
        if not grads and not trains and s != topo.loss_stage:
            out.add(s)
    return out
