"""Freeze training (PipeTransformer-style): which layers freeze when (`layers`), the training
mode and its segments (`mode`), and the hand-over to a shorter plan (`elastic`)."""
