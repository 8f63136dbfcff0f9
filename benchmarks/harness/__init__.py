"""Shared by the sections: launching ranks (launch), a timed part's set-up run
beside the compute-only parts (set_up), step statistics (stats), action timings
from a run's trace (actions), the hand-cut reference model (reference) and the ranks' workers
(started as torchrun starts them, `launch.torchrun`)."""
