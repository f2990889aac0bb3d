"""Pod checkpoints through an OCI registry (docs/design/distribution.md (Checkpoints through a
registry)): push.push() and pull.pull(), the library API the `podshim push/pull` commands use."""
