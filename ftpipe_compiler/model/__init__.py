"""Which model, which task, and what of it is frozen."""
