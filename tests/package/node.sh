#!/bin/sh
# What an operator does on a Debian node with containerd running, in a fresh root, with the
# installed package only (no checkout; crictl is the node's CRI client): install, `podshim node
# setup`, restart containerd, start podshim, `podshim doctor`, the demo flow (a counter pod
# checkpointed and restored, the counter resumes), then remove and purge the package and check
# what is left. Prints PASS at the end; any failure exits non-zero naming the step.
set -eu
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. /var/tmp/node.env   # CGROUP: a cgroup parent of this run (removed by the test afterwards)
step() { echo "==> $*"; }
fail() {
	echo "FAILED: $*"
	/usr/local/bin/crictl -r unix:///run/podshim/podshim.sock ps -a 2>&1 | sed 's/^/    /' || true
	find /var/log/pods -type f | head | sed 's/^/    /'
	ps -eo pid,ppid,stat,wchan:20,args | sed 's/^/    /'
	for id in $(/usr/local/bin/crictl -r unix:///run/podshim/podshim.sock ps -aq 2>/dev/null); do
		/usr/local/bin/crictl -r unix:///run/podshim/podshim.sock logs --tail 3 "$id" 2>&1 | sed 's/^/    /'
	done
	[ -z "${HOLD_ON_FAILURE:-}" ] || sleep "$HOLD_ON_FAILURE"
	exit 1
}
crictl() { /usr/local/bin/crictl -r unix:///run/podshim/podshim.sock -t 60s "$@"; }
wait_for() {  # WHAT SECONDS COMMAND...
	wait_what=$1 wait_tries=$(( $2 * 10 )); shift 2
	while ! "$@" >/dev/null 2>&1; do
		wait_tries=$(( wait_tries - 1 )); [ "$wait_tries" -gt 0 ] || fail "timed out waiting for $wait_what"
		sleep 0.1
	done
}
last_count() { crictl logs "$1" 2>/dev/null | sed -n 's/.*count=\([0-9]*\).*/\1/p' | tail -n 1; }
first_count() { crictl logs "$1" 2>/dev/null | sed -n 's/.*count=\([0-9]*\).*/\1/p' | head -n 1; }
count_at_least() { counted=$(last_count "$1"); [ -n "$counted" ] && [ "$counted" -ge "$2" ]; }
start_containerd() {
	containerd >>/var/log/containerd.log 2>&1 &
	CONTAINERD=$!
	wait_for "containerd's socket" 30 ctr version
}
stop() {  # PID: this shell is PID 1 here, so it reaps what it started
	kill -TERM "$1"
	wait "$1" || true
}

step "the node before podshim: Debian's containerd $(containerd --version | awk '{print $3}'), its runc, a CNI bridge"
# the operator's CRI setting: a pause image this node has (no registry here)
sed -i 's|^\(\s*\)\[plugins."io.containerd.grpc.v1.cri"\]$|&\n\1  sandbox_image = "localhost/podshim/pause:1"|' /etc/containerd/config.toml
grep -q sandbox_image /etc/containerd/config.toml || fail "could not set sandbox_image"
mkdir -p /etc/cni/net.d
cat >/etc/cni/net.d/10-node.conflist <<JSON
{"cniVersion": "1.0.0", "name": "node", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.99.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
JSON
start_containerd
for t in /var/tmp/images/*.tar; do ctr -n k8s.io images import --all-platforms "$t" >/dev/null; done
config_before=$(cat /etc/containerd/config.toml)

step "apt-get install ./package.deb (its dependencies fetched before; no network here)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq /var/tmp/package.deb 2>&1 | tail -n 3
[ "$(pgrep -x containerd)" = "$CONTAINERD" ] || fail "installing restarted containerd"
[ "$(cat /etc/containerd/config.toml)" = "$config_before" ] || fail "installing changed containerd's config"
! pgrep -f "podshim serve" >/dev/null || fail "installing started podshim"
command -v podshim | grep -qx /usr/bin/podshim || fail "podshim is not /usr/bin/podshim"
dpkg -L podshim | grep -c . | sed 's/^/    files: /'

step "the manual pages: man podshim-checkpointpod, man 5 podshim-config.toml"
for name in 1:podshim-checkpointpod 5:podshim-config.toml; do
	section=${name%%:*} name=${name#*:}
	if command -v man >/dev/null; then
		page=$(man -w "$section" "$name") || fail "man -w $section $name finds no page"
	else  # a root without man-db: the installed file itself
		page=/usr/share/man/man$section/$name.$section.gz
		[ -f "$page" ] || fail "$page is not installed"
	fi
	# the page's title line, as docs/man/ has it: .TH PODSHIM\-CHECKPOINTPOD "1" ...
	title=$(printf '%s' "$name" | tr a-z A-Z | sed 's/-/\\-/g')
	case $(zcat -f "$page" | head -n 1) in
	".TH $title \"$section\""*) ;;
	*) fail "$page does not start with the .TH of $name($section)" ;;
	esac
	echo "    man page: $page"
done

step "podshim node setup --dry-run"
podshim node setup --dry-run
[ "$(cat /etc/containerd/config.toml)" = "$config_before" ] || fail "--dry-run changed the config"
step "podshim node setup"
podshim node setup
step "podshim node setup (again: nothing to change)"
podshim node setup | grep -q "nothing to change" || fail "a second node setup changed something"

step "restart containerd; start podshim"
stop "$CONTAINERD"
start_containerd
podshim serve --config /etc/podshim/config.toml >>/var/log/shim.log 2>&1 &
PODSHIM=$!
wait_for "podshim's socket" 30 podshim pods

step "podshim doctor"
podshim doctor || fail "podshim doctor failed on the node set up"

step "the demo flow: a counter pod, CheckpointPod, RestorePod, the counter resumes"
cat >/var/tmp/pod.json <<JSON
{"metadata": {"name": "counter", "namespace": "default", "uid": "0a1b2c3d4e5f6789", "attempt": 0},
 "hostname": "counter", "log_directory": "/var/log/pods/default_counter_0a1b2c3d4e5f6789",
 "linux": {"cgroup_parent": "$CGROUP/pod0a1b2c3d4e5f6789",
           "security_context": {"namespace_options": {"network": 0, "pid": 1, "ipc": 0}}}}
JSON
cat >/var/tmp/counter.json <<JSON
{"metadata": {"name": "counter", "attempt": 0}, "image": {"image": "localhost/podshim/counter:1"},
 "args": ["--mem-mib", "16", "--interval-ms", "100"], "log_path": "counter.log",
 "linux": {"security_context": {"namespace_options": {"network": 0, "pid": 1, "ipc": 0}}}}
JSON
mkdir -p /var/log/pods/default_counter_0a1b2c3d4e5f6789
pod=$(crictl runp /var/tmp/pod.json)
ctr_id=$(crictl create "$pod" /var/tmp/counter.json /var/tmp/pod.json)
crictl start "$ctr_id" >/dev/null
wait_for "the counter to reach 10" 60 count_at_least "$ctr_id" 10
before=$(last_count "$ctr_id")
podshim checkpointpod "$pod" /var/lib/kubelet/pod-checkpoints/counter
podshim restorepod /var/lib/kubelet/pod-checkpoints/counter --start -o json >/var/tmp/restored.json
new_ctr=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["restoredContainers"][0]["containerId"])' /var/tmp/restored.json)
new_pod=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["podSandboxId"])' /var/tmp/restored.json)
wait_for "the restored counter's output" 60 count_at_least "$new_ctr" 1
first=$(first_count "$new_ctr")
echo "    counted $before before CheckpointPod; the restored counter resumed at $first"
[ "$first" -gt "$before" ] || fail "the restored counter started at $first, not after $before"
wait_for "the restored counter to count on" 30 count_at_least "$new_ctr" $(( first + 5 ))
for p in "$pod" "$new_pod"; do crictl stopp "$p" >/dev/null; crictl rmp "$p" >/dev/null; done

step "podshim doctor (after the flow)"
podshim doctor >/dev/null || fail "podshim doctor failed after the demo flow"

step "apt-get remove podshim: only the operator's config stays, containerd's config as it was"
stop "$PODSHIM"
apt-get remove -y -qq podshim 2>&1 | tail -n 3
for gone in /opt/podshim /usr/bin/podshim /usr/lib/systemd/system/podshim.service /var/lib/podshim \
	/etc/containerd/conf.d/podshim.toml /usr/share/man/man1/podshim-checkpointpod.1.gz; do
	[ ! -e "$gone" ] || fail "$gone is still there after apt-get remove"
done
[ -f /etc/podshim/config.toml ] || fail "the operator's /etc/podshim/config.toml went with apt-get remove"
[ "$(cat /etc/containerd/config.toml)" = "$config_before" ] || fail "containerd's config is not as it was"
step "dpkg --purge podshim"
dpkg --purge podshim >/dev/null
[ ! -e /etc/podshim ] || fail "/etc/podshim is still there after the purge"
echo "    left, naming podshim (the operator's: backups of containerd's config, the checkpoint):"
find / -xdev -name '*podshim*' -not -path '/proc/*' | sort | sed 's/^/    /'
echo PASS
