"""The traced operator graph of a model: `trace.py` (torch.export -> OpGraph), `opgraph.py`
(the graph type and its JSON), `granularity.py` (op or layer nodes). See docs/architecture.md."""
