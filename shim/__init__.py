"""podshim: a CRI runtime shim adding Pod checkpoint/restore in front of an upstream runtime."""

__version__ = "0.1.0"
