"""The torch layer's error, importable without torch (the CLI lists it among bad-input errors)."""

from __future__ import annotations


class TorchImportError(ValueError):
    """A torch module could not be imported: untraceable code, a bad dtype or mismatched inputs."""
