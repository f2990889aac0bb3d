//go:build tools

// Package tools pins a runtime the test bed runs (scripts/gotools.sh builds it).
package tools

import (
	_ "github.com/opencontainers/runc"
)
