"""Fault injection: podshim, CRIU, containerd and the disk failing mid-operation."""
