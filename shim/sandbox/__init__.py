"""The pod view: sandbox + containers + cgroups + namespaces, built from upstream status."""

from shim.sandbox.view import ContainerView, PodView, build_pod_view

__all__ = ["ContainerView", "PodView", "build_pod_view"]
