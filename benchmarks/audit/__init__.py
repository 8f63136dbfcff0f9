"""The reliability audit (`python -m benchmarks.audit`): bad inputs and faults, each run as a
user meets it, checked for its exit code, one sentence, no traceback and every earlier file
intact; the table it writes is docs/reliability.md. Not a `make bench` section: it measures
behaviour, not speed.

    python -m benchmarks.audit                      # every case; writes docs/reliability.md
    python -m benchmarks.audit -k resume --keep /tmp/a   # the cases matching, folders kept

workspace.py builds the files the cases start from (a tiny Llama folder, data in every
format, packages for 1 and 2 ranks, a finished run's checkpoints); harness.py runs one case
and checks it; cases_*.py are the tables; report.py writes the markdown.
"""
