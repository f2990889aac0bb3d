"""The CRI client to the upstream runtime (containerd or CRI-O)."""

from shim.upstream.client import Upstream, upstream_error

__all__ = ["Upstream", "upstream_error"]
