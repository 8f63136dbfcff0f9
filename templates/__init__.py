"""Data package: the Jinja templates of generated packages and reports."""
