"""Pod checkpoints through an OCI registry (docs/architecture.md §10 (Checkpoints through a
registry)): push.push() and pull.pull(), the library API the `podshim push/pull` commands use."""
