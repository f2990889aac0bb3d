"""podshim's private test bed: its own containerd (+ podshim) with locally built images."""

from testbed.bed import (
    BUSYBOX_IMAGE,
    COUNTER_IMAGE,
    IMAGES,
    PAUSE_IMAGE,
    TestBed,
    TestBedError,
)

__all__ = ["BUSYBOX_IMAGE", "COUNTER_IMAGE", "IMAGES", "PAUSE_IMAGE", "TestBed", "TestBedError"]
