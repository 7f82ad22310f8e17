"""The error every model-loading failure raises (its own module so that the loader and the
weight-file reader share it without importing each other)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model reference or directory that cannot be loaded; the message says what and where
    (the file, the tensor or the config field)."""
