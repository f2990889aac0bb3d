#!/bin/sh
# The host side of tests/test_package.py, run by `unshare --mount --pid --fork` as
# `enter.sh outside ROOT SCRATCH`: ROOT is a fresh Debian root (an overlay on scripts/setup.sh's
# pristine one), made this mount namespace's root with pivot_root (CRIU refuses to dump from a
# chroot: "The root task has another root than mntns"), then `enter.sh inside` (its copy in the
# root) mounts what a node has (its own /proc, an empty /run and /tmp; /sys, /dev and containerd's
# root on SCRATCH, where containerd's overlayfs snapshots can be made, came from outside), all of
# it ending with this namespace; fetches the package's dependencies from the Debian mirror (the
# network is needed for that only) and runs node.sh in a network namespace of its own (its CNI
# bridge clashes with nothing).
set -eu
case $1 in
outside)
	ROOT=$2
	mount --make-rprivate /
	mkdir -p "$ROOT/var/lib/containerd" "$ROOT/.host"
	mount --bind "$3" "$ROOT/var/lib/containerd"
	mount --rbind /sys "$ROOT/sys"
	mount --rbind /dev "$ROOT/dev"
	cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
	cd "$ROOT"
	pivot_root . .host
	exec chroot . /bin/sh /var/tmp/enter.sh inside
	;;
inside)
	export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
	mount -t proc proc /proc  # (umount reads the mount table from it)
	umount -l /.host
	rmdir /.host
	mount -t tmpfs -o mode=0755 tmpfs /run
	mount -t tmpfs -o mode=1777 tmpfs /tmp
	echo "==> apt-get update; apt-get install --download-only the package (from the mirror; then offline)"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --download-only /var/tmp/package.deb
	exec unshare --net sh -c 'ip link set lo up && exec /bin/sh /var/tmp/node.sh'
	;;
esac
