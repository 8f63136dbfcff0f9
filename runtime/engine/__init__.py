"""Executing a rank's action lists: the messages and steps they imply (`dataflow`), point-to-point
transfers and collectives (`comm`), each action's work (`executor`, `act_offload`, `outputs`,
`split_backward`), evaluation rounds spliced in (`evaluate`), per-action timings (`trace`),
and the wiring of these parts for a run (`assemble`)."""
