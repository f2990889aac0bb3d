"""The gRPC layer: CRI servicers. No business logic here."""
