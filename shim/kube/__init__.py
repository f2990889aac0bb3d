"""The cluster API podshim serves for the pods of its node (docs/cluster.md): KEP-5823's
PodCheckpoint objects, acted on as the KEP's kubelet would (controller.py), and Pods that name a
checkpoint to restore from, restored through the kubelet's own CRI calls (restore.py)."""
