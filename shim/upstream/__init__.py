"""The CRI client to the upstream runtime (containerd or CRI-O): the channel, the typed calls
(calls.py) and the mapping of its gRPC errors (errors.py); `is_not_found` tells the upstream's
NOT_FOUND from podshim's own (shim/errors.py)."""

from shim.errors import is_not_found
from shim.upstream.client import Upstream, upstream_error

__all__ = ["Upstream", "is_not_found", "upstream_error"]
