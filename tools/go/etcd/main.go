// Command etcd: go.etcd.io/etcd/server/v3's etcdmain, built as a main module of the project's own
// because server/v3's go.mod has replace lines (`go install` of it is refused).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
