"""The node tools: `podshim node setup` wires containerd for podshim, `podshim doctor` checks a node
end to end (docs/design/install.md (Installing a node))."""
