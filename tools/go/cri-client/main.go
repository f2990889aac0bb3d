// cri-client: the project's Go CRI client, built against the released CRI API (k8s.io/cri-api
// v0.37.2: its generated stubs) and the kubelet's own CRI client code (k8s.io/cri-client v0.37.2,
// RemoteRuntimeService: the caller's deadline bounds CheckpointPod/RestorePod). It drives podshim
// the way the kubelet's KEP-5823 code will (docs/design/testbed.md (The released API's Go
// client)); tests/test_kubelet_restore.py runs it. Every command prints one JSON object on stdout:
// {"code": "OK" | <gRPC code name>, "message": ..., ...}; the exit code is 0 when the call
// answered OK, 3 when it answered an error, 2 on bad usage or an unreachable endpoint.
//
//	cri-client checkpoint-pod --endpoint E --pod-uid UID --output DIR [--timeout 2m]
//	cri-client restore-pod --endpoint E --checkpoint DIR --manifest POD.json --name N --uid U
//	    [--namespace NS] [--kubelet-root /var/lib/kubelet] --pod-logs-dir D --cgroup-root R
//	    [--image-as id|digest|name] [--image CONTAINER=REF] [--no-start] [--timeout 2m]
//	cri-client env-bytes --endpoint E --image IMG --log-dir D --cgroup-parent P
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc/status"
	internalapi "k8s.io/cri-api/pkg/apis"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	remote "k8s.io/cri-client/pkg"
)

const connectTimeout = 10 * time.Second

// The kubelet's defaults for a container of a static pod (pkg/kubelet/kuberuntime,
// pkg/securitycontext): what it sent podshim in docs/kubelet-calls.md.
var (
	maskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys",
		"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
		"/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// The parts of a Pod manifest (the static pod the kubelet ran) that shape the restore request.
type manifest struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		Containers                    []container `json:"containers"`
		Volumes                       []volume    `json:"volumes"`
		TerminationGracePeriodSeconds *int64      `json:"terminationGracePeriodSeconds"`
	} `json:"spec"`
}

type container struct {
	Name         string        `json:"name"`
	Image        string        `json:"image"`
	Command      []string      `json:"command"`
	Args         []string      `json:"args"`
	WorkingDir   string        `json:"workingDir"`
	Env          []envVar      `json:"env"`
	VolumeMounts []volumeMount `json:"volumeMounts"`
}

type envVar struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

type volume struct {
	Name     string          `json:"name"`
	EmptyDir json.RawMessage `json:"emptyDir"`
}

type volumeMount struct {
	Name      string `json:"name"`
	MountPath string `json:"mountPath"`
	ReadOnly  bool   `json:"readOnly"`
}

type result map[string]any

func main() {
	if len(os.Args) < 2 {
		usage("a command: checkpoint-pod, restore-pod or env-bytes")
	}
	var out result
	var err error
	switch os.Args[1] {
	case "checkpoint-pod":
		out, err = checkpointPod(os.Args[2:])
	case "restore-pod":
		out, err = restorePod(os.Args[2:])
	case "env-bytes":
		out, err = envBytes(os.Args[2:])
	default:
		usage("unknown command " + os.Args[1])
	}
	if out == nil {
		out = result{}
	}
	rc := 0
	if err != nil {
		st, ok := status.FromError(err)
		if !ok {
			fmt.Fprintln(os.Stderr, "cri-client:", err)
			os.Exit(2)
		}
		out["code"], out["message"], rc = st.Code().String(), st.Message(), 3
	} else {
		out["code"] = "OK"
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(2)
	}
	os.Exit(rc)
}

func usage(why string) {
	fmt.Fprintln(os.Stderr, "cri-client:", why, "(see the head of tools/go/cri-client/main.go)")
	os.Exit(2)
}

func parse(fs *flag.FlagSet, args []string) {
	if err := fs.Parse(args); err != nil || fs.NArg() != 0 {
		usage("bad arguments for " + fs.Name())
	}
}

func runtimeService(ctx context.Context, endpoint string) internalapi.RuntimeService {
	rs, err := remote.NewRemoteRuntimeService(ctx, endpoint, connectTimeout, nil, false)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cri-client: runtime service:", err)
		os.Exit(2)
	}
	return rs
}

func imageService(ctx context.Context, endpoint string) internalapi.ImageManagerService {
	is, err := remote.NewRemoteImageService(ctx, endpoint, connectTimeout, nil, false)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cri-client: image service:", err)
		os.Exit(2)
	}
	return is
}

// checkpointPod: CheckpointPod of the READY sandbox of pod UID with its running containers and
// an empty options map, under a deadline: what the kubelet does for a PodCheckpoint.
func checkpointPod(args []string) (result, error) {
	fs := flag.NewFlagSet("checkpoint-pod", flag.ExitOnError)
	endpoint := fs.String("endpoint", "", "CRI endpoint (unix://...)")
	uid := fs.String("pod-uid", "", "the pod's uid")
	output := fs.String("output", "", "an existing, empty directory")
	timeout := fs.Duration("timeout", 2*time.Minute, "the call's deadline")
	parse(fs, args)
	ctx := context.Background()
	rs := runtimeService(ctx, *endpoint)
	sandboxes, err := rs.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{
		State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": *uid},
	})
	if err != nil {
		return nil, err
	}
	if len(sandboxes) != 1 {
		return nil, fmt.Errorf("pod uid %s: %d ready sandboxes", *uid, len(sandboxes))
	}
	containers, err := rs.ListContainers(ctx, &runtimeapi.ContainerFilter{
		PodSandboxId: sandboxes[0].Id,
		State:        &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
	})
	if err != nil {
		return nil, err
	}
	ids := make([]string, 0, len(containers))
	for _, c := range containers {
		ids = append(ids, c.Id)
	}
	dctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	start := time.Now()
	err = rs.CheckpointPod(dctx, &runtimeapi.CheckpointPodRequest{
		PodSandboxId: sandboxes[0].Id,
		OutputPath:   *output,
		ContainerIds: ids,
		Options:      map[string]string{},
	})
	return result{"pod_sandbox_id": sandboxes[0].Id, "container_ids": ids, "seconds": time.Since(start).Seconds()}, err
}

type imageFlags map[string]string

func (f imageFlags) String() string { return fmt.Sprint(map[string]string(f)) }
func (f imageFlags) Set(v string) error {
	k, ref, ok := strings.Cut(v, "=")
	if !ok {
		return errors.New("CONTAINER=REF expected")
	}
	f[k] = ref
	return nil
}

// restorePod: RestorePod with the pod's sandbox and container configs built as the kubelet
// builds them for a new pod from the checkpointed pod's spec (a new uid, name and log dir, the
// image by its ID plus the name the spec gives, the new pod's own /etc/hosts, termination log
// and emptyDirs), then StartContainer of each restored container.
func restorePod(args []string) (result, error) {
	fs := flag.NewFlagSet("restore-pod", flag.ExitOnError)
	endpoint := fs.String("endpoint", "", "CRI endpoint (unix://...)")
	checkpoint := fs.String("checkpoint", "", "the pod checkpoint directory")
	manifestPath := fs.String("manifest", "", "the checkpointed pod's manifest (JSON)")
	name := fs.String("name", "", "the new pod's name")
	uid := fs.String("uid", "", "the new pod's uid")
	namespace := fs.String("namespace", "", "the new pod's namespace (default: the manifest's)")
	kubeletRoot := fs.String("kubelet-root", "/var/lib/kubelet", "the kubelet's root dir (per-pod files)")
	podLogsDir := fs.String("pod-logs-dir", "/var/log/pods", "the kubelet's podLogsDir")
	cgroupRoot := fs.String("cgroup-root", "", "the kubelet's cgroupRoot")
	imageAs := fs.String("image-as", "id", "how the image is named: id (the kubelet), digest or name")
	images := imageFlags{}
	fs.Var(images, "image", "CONTAINER=REF: name that container's image so (overrides --image-as)")
	noStart := fs.Bool("no-start", false, "leave the restored containers CREATED")
	timeout := fs.Duration("timeout", 2*time.Minute, "the RestorePod call's deadline")
	parse(fs, args)

	var m manifest
	raw, err := os.ReadFile(*manifestPath)
	if err == nil {
		err = json.Unmarshal(raw, &m)
	}
	if err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	ns := *namespace
	if ns == "" {
		ns = m.Metadata.Namespace
	}
	ctx := context.Background()
	rs, is := runtimeService(ctx, *endpoint), imageService(ctx, *endpoint)

	podDir := filepath.Join(*kubeletRoot, "pods", *uid)
	sandbox := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: *name, Uid: *uid, Namespace: ns},
		Hostname:     *name,
		LogDirectory: filepath.Join(*podLogsDir, fmt.Sprintf("%s_%s_%s", ns, *name, *uid)),
		DnsConfig:    resolvConf(),
		Labels: map[string]string{
			"io.kubernetes.pod.name": *name, "io.kubernetes.pod.namespace": ns, "io.kubernetes.pod.uid": *uid,
		},
		Annotations: map[string]string{"kubernetes.io/config.source": "file", "kubernetes.io/config.seen": time.Now().UTC().Format(time.RFC3339Nano)},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: fmt.Sprintf("%s/kubepods/besteffort/pod%s", *cgroupRoot, *uid),
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{
					Pid: runtimeapi.NamespaceMode_CONTAINER, UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_NODE},
				},
				Seccomp: &runtimeapi.SecurityProfile{},
			},
		},
	}
	if err := os.MkdirAll(sandbox.LogDirectory, 0o755); err != nil {
		return nil, err
	}
	hosts := filepath.Join(podDir, "etc-hosts")
	if err := writeHosts(hosts, *name); err != nil {
		return nil, err
	}

	configs := make([]*runtimeapi.ContainerConfig, 0, len(m.Spec.Containers))
	sent := map[string]string{}
	for _, c := range m.Spec.Containers {
		ref, ok := images[c.Name]
		if !ok {
			if ref, err = imageRef(ctx, is, c.Image, *imageAs); err != nil {
				return nil, err
			}
		}
		sent[c.Name] = ref
		cc, err := containerConfig(c, &m, sandbox, podDir, hosts, ref)
		if err != nil {
			return nil, err
		}
		configs = append(configs, cc)
	}

	dctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	start := time.Now()
	resp, err := rs.RestorePod(dctx, &runtimeapi.RestorePodRequest{
		CheckpointPath:   *checkpoint,
		Config:           sandbox,
		Options:          map[string]string{},
		ContainerConfigs: configs,
	})
	out := result{"images": sent, "restore_seconds": time.Since(start).Seconds()}
	if err != nil {
		return out, err
	}
	restored := map[string]string{}
	for _, rc := range resp.RestoredContainers {
		restored[rc.Name] = rc.ContainerId
	}
	out["pod_sandbox_id"], out["containers"] = resp.PodSandboxId, restored
	if *noStart {
		return out, nil
	}
	for _, rc := range resp.RestoredContainers { // the kubelet: pre-start hooks, then StartContainer
		if err := rs.StartContainer(ctx, rc.ContainerId); err != nil {
			return out, err
		}
	}
	out["started"] = true
	return out, nil
}

// imageRef names image `name` as the kubelet does (its ID, from ImageStatus) or by a digest
// reference or by the name itself.
func imageRef(ctx context.Context, is internalapi.ImageManagerService, name, as string) (string, error) {
	if as == "name" {
		return name, nil
	}
	st, err := is.ImageStatus(ctx, &runtimeapi.ImageSpec{Image: name}, false)
	if err != nil {
		return "", err
	}
	if st.GetImage() == nil {
		return "", fmt.Errorf("image %s is not on the node", name)
	}
	switch as {
	case "id":
		return st.Image.Id, nil
	case "digest":
		if len(st.Image.RepoDigests) == 0 {
			return "", fmt.Errorf("image %s has no repo digest", name)
		}
		return st.Image.RepoDigests[0], nil
	}
	return "", fmt.Errorf("--image-as %s: id, digest or name expected", as)
}

func containerConfig(c container, m *manifest, sandbox *runtimeapi.PodSandboxConfig, podDir, hosts, ref string) (*runtimeapi.ContainerConfig, error) {
	meta := sandbox.Metadata
	envs := make([]*runtimeapi.KeyValue, 0, len(c.Env))
	for _, e := range c.Env {
		envs = append(envs, &runtimeapi.KeyValue{Key: e.Name, Value: []byte(e.Value)})
	}
	var mounts []*runtimeapi.Mount
	for _, vm := range c.VolumeMounts { // emptyDir volumes: the new pod's own directories
		dir := filepath.Join(podDir, "volumes", "kubernetes.io~empty-dir", vm.Name)
		if err := os.MkdirAll(dir, 0o777); err != nil {
			return nil, err
		}
		mounts = append(mounts, &runtimeapi.Mount{ContainerPath: vm.MountPath, HostPath: dir, Readonly: vm.ReadOnly})
	}
	termination := filepath.Join(podDir, "containers", c.Name, randomHex(4))
	if err := os.MkdirAll(filepath.Dir(termination), 0o750); err != nil {
		return nil, err
	}
	if err := os.WriteFile(termination, nil, 0o666); err != nil {
		return nil, err
	}
	mounts = append(mounts,
		&runtimeapi.Mount{ContainerPath: "/etc/hosts", HostPath: hosts},
		&runtimeapi.Mount{ContainerPath: "/dev/termination-log", HostPath: termination},
	)
	spec, _ := json.Marshal(c)
	h := fnv.New32a()
	h.Write(spec)
	annotations := map[string]string{
		"io.kubernetes.container.hash":                     fmt.Sprintf("%x", h.Sum32()),
		"io.kubernetes.container.restartCount":             "0",
		"io.kubernetes.container.terminationMessagePath":   "/dev/termination-log",
		"io.kubernetes.container.terminationMessagePolicy": "File",
	}
	if g := m.Spec.TerminationGracePeriodSeconds; g != nil {
		annotations["io.kubernetes.pod.terminationGracePeriod"] = fmt.Sprint(*g)
	}
	return &runtimeapi.ContainerConfig{
		Metadata:   &runtimeapi.ContainerMetadata{Name: c.Name},
		Image:      &runtimeapi.ImageSpec{Image: ref, UserSpecifiedImage: c.Image},
		Command:    c.Command,
		Args:       c.Args,
		WorkingDir: c.WorkingDir,
		Envs:       envs,
		Mounts:     mounts,
		LogPath:    filepath.Join(c.Name, "0.log"),
		Labels: map[string]string{
			"io.kubernetes.container.name": c.Name, "io.kubernetes.pod.name": meta.Name,
			"io.kubernetes.pod.namespace": meta.Namespace, "io.kubernetes.pod.uid": meta.Uid,
		},
		Annotations: annotations,
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources: &runtimeapi.LinuxContainerResources{CpuPeriod: 100000, CpuShares: 2, OomScoreAdj: 1000},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{
					Pid: runtimeapi.NamespaceMode_CONTAINER, UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_NODE},
				},
				RunAsUser:     &runtimeapi.Int64Value{Value: 0}, // the image's user, as the kubelet reads it
				MaskedPaths:   maskedPaths,
				ReadonlyPaths: readonlyPaths,
				Seccomp:       &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Unconfined},
			},
		},
	}, nil
}

// writeHosts writes the pod's /etc/hosts as the kubelet's ensureHostsFile does.
func writeHosts(path, hostname string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return err
	}
	content := "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" +
		"fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n" +
		"127.0.1.1\t" + hostname + "\n"
	return os.WriteFile(path, []byte(content), 0o644)
}

func resolvConf() *runtimeapi.DNSConfig {
	dns := &runtimeapi.DNSConfig{}
	raw, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		return dns
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "nameserver":
			dns.Servers = append(dns.Servers, f[1])
		case "search":
			dns.Searches = append(dns.Searches, f[1:]...)
		case "options":
			dns.Options = append(dns.Options, f[1:]...)
		}
	}
	return dns
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// envBytes: a pod whose container gets an environment value that is not UTF-8 (the released
// API's KeyValue.value is bytes); the container prints what it sees, in hex. Cleans up after.
func envBytes(args []string) (result, error) {
	fs := flag.NewFlagSet("env-bytes", flag.ExitOnError)
	endpoint := fs.String("endpoint", "", "CRI endpoint (unix://...)")
	img := fs.String("image", "", "a busybox image on the node")
	logDir := fs.String("log-dir", "", "the pod's log directory")
	cgroupParent := fs.String("cgroup-parent", "", "the pod's cgroup parent")
	parse(fs, args)
	ctx := context.Background()
	rs := runtimeService(ctx, *endpoint)
	uid := randomHex(8)
	sandbox := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: "env-bytes-" + uid, Uid: uid, Namespace: "cri-client"},
		LogDirectory: *logDir,
		Linux:        &runtimeapi.LinuxPodSandboxConfig{CgroupParent: *cgroupParent},
	}
	podID, err := rs.RunPodSandbox(ctx, sandbox, "")
	if err != nil {
		return nil, err
	}
	defer func() {
		_ = rs.StopPodSandbox(ctx, podID)
		_ = rs.RemovePodSandbox(ctx, podID)
	}()
	value := []byte{0xff, 'x', 0xfe}
	cid, err := rs.CreateContainer(ctx, podID, &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "env"},
		Image:    &runtimeapi.ImageSpec{Image: *img},
		Command:  []string{"sleep", "3600"},
		Envs:     []*runtimeapi.KeyValue{{Key: "RAW", Value: value}},
		LogPath:  "env.log",
	}, sandbox)
	if err != nil {
		return result{"sent": hex.EncodeToString(value)}, err
	}
	if err := rs.StartContainer(ctx, cid); err != nil {
		return nil, err
	}
	stdout, _, err := rs.ExecSync(ctx, cid, []string{"sh", "-c", `printf %s "$RAW" | od -An -tx1`}, 10*time.Second)
	seen := strings.Join(strings.Fields(string(stdout)), "")
	return result{"sent": hex.EncodeToString(value), "seen": seen}, err
}
