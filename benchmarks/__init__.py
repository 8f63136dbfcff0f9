"""`make bench`: one subpackage per BENCHMARKS.md section, run by `python -m benchmarks`."""
