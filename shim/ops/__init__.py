"""podshim's own operations, one module each: checkpoint_pod (CheckpointPod), restore_pod
(RestorePod), checkpoint_container (CheckpointContainer), restore_container (CreateContainer from a
container checkpoint tar). The engine (shim/engine.py) runs them under its locks, metrics and recovery."""
