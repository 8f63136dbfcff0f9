"""Shared by the sections: launching ranks (launch), step statistics (stats), action timings
from a run's trace (actions), the hand-cut reference model (reference) and the ranks' workers
(started as torchrun starts them, `launch.torchrun`)."""
