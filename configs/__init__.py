"""Data package: the shipped model, hardware and task configs (JSON)."""
