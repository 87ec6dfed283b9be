# Source this file (". scripts/podman-env.sh") before podman / buildah commands on a host without
# systemd and with cgroup v1 (runc, cgroupfs, ulimits the host grants): it points podman at the
# project's own configuration file and changes nothing else on the machine.
CONTAINERS_CONF="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker/podman/containers.conf"
export CONTAINERS_CONF
