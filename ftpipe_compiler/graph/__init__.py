"""The traced operator graph of a model."""
