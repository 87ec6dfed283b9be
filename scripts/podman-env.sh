# Source this file (". scripts/podman-env.sh") before podman / buildah commands on a host without
# systemd and with cgroup v1 (runc, cgroupfs, ulimits the host grants): it points podman at the
# project's own configuration file and changes nothing else on the machine.
CONTAINERS_CONF="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker/podman/containers.conf"
export CONTAINERS_CONF
# netavark (podman's network stack) runs iptables from the caller's PATH: a minimal PATH without
# the sbin folders (CI runners, `env -i`) fails every networked build step with
# "netavark: No such file or directory".
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin:/sbin"; export PATH ;; esac
