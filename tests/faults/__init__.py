"""Fault injection (issue 6 item 2): podshim, CRIU, containerd and the disk failing mid-operation."""
