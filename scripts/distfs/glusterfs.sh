#!/usr/bin/env bash
# GlusterFS on 127.0.0.1 for the shared-tier tests and benchmarks: one glusterd, two one-brick
# volumes, each mounted twice through FUSE (two "nodes" per volume).
#
#   scripts/distfs/glusterfs.sh up STATE_DIR     # prints the four mount points, NAME=PATH
#   scripts/distfs/glusterfs.sh down STATE_DIR   # unmounts, stops every daemon it started, removes STATE_DIR
#
# Volumes and mounts:
#   kvdefault: GlusterFS defaults (volume performance translators on, FUSE attribute and entry
#              timeouts of 1 s); mounted at STATE_DIR/mnt/default-a and default-b.
#   kvstrict:  strict caching: stat-prefetch, quick-read, open-behind, io-cache, read-ahead and
#              readdir-ahead off, and clients run with --attribute-timeout=0 --entry-timeout=0
#              --negative-timeout=0 --fopen-keep-cache=false (glusterfs is run directly: mount.glusterfs
#              mangles the last option); mounted at STATE_DIR/mnt/strict-a and strict-b.
# Everything listens on 127.0.0.1 only. The gluster CLI refuses 127.0.0.1 and localhost as a brick
# host, so bricks are on the host name kvtier-brick, which must resolve to 127.0.0.1 (scripts/setup.sh
# adds "127.0.0.1 kvtier-brick" to /etc/hosts). glusterd's state lives in STATE_DIR (its own
# glusterd.vol), not /var/lib/glusterd. Needs root, /dev/fuse and Debian's glusterfs-server and
# glusterfs-client. Port 24007 must be free (one instance per machine).
set -euo pipefail
cmd=${1:?usage: glusterfs.sh up|down STATE_DIR}
state=${2:?usage: glusterfs.sh up|down STATE_DIR}
host=${KVTIER_GLUSTER_HOST:-kvtier-brick}
vols=(kvdefault kvstrict)
mounts=(default-a default-b strict-a strict-b)
log() { printf '[glusterfs %s] %s\n' "$(date +%T)" "$*" >&2; }

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

down() {
    set +e # tear down as much as possible, whatever fails
    [[ -d $state ]] || return 0
    unmount_all
    for v in "${vols[@]}"; do
        for f in /var/run/gluster/vols/"$v"/*.pid; do
            [[ -e $f ]] || continue
            # Only bricks of this state directory.
            if { tr '\0' ' ' <"/proc/$(cat "$f")/cmdline"; } 2>/dev/null | grep -q -- "--brick-name $state/bricks/$v "; then
                kill_pidfile "$f"
            fi
        done
    done
    kill_pidfile "$state/run/glusterd.pid"
    sweep_state_processes
    local brick_log_prefix
    brick_log_prefix=$(echo "$state/bricks/" | sed 's#^/##; s#/#-#g')
    rm -f /var/log/glusterfs/bricks/"$brick_log_prefix"*.log
    rm -rf "$state"
    log "down: $state removed"
}

up() {
    [[ $(id -u) -eq 0 ]] || { echo "glusterfs.sh needs root (FUSE mounts and glusterd)" >&2; exit 3; }
    command -v glusterd >/dev/null && command -v glusterfs >/dev/null \
        || { echo "glusterd/glusterfs missing: apt-get install glusterfs-server glusterfs-client (scripts/setup.sh does as root)" >&2; exit 3; }
    [[ -c /dev/fuse ]] || { echo "/dev/fuse missing: load the fuse module or run the container with --device /dev/fuse" >&2; exit 3; }
    getent hosts "$host" | grep -q '^127\.0\.0\.1' \
        || { echo "$host does not resolve to 127.0.0.1: add '127.0.0.1 $host' to /etc/hosts (scripts/setup.sh does as root)" >&2; exit 3; }
    down
    set -e
    mkdir -p "$state"/{wd,bricks,mnt,logs,run}
    cat >"$state/glusterd.vol" <<VOL
volume management
    type mgmt/glusterd
    option working-directory $state/wd
    option transport-type socket
    option transport.socket.bind-address 127.0.0.1
    option transport.socket.listen-port 24007
    option glusterd-sockfile $state/run/glusterd.socket
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
VOL
    glusterd -f "$state/glusterd.vol" -p "$state/run/glusterd.pid" -l "$state/logs/glusterd.log" --log-level=WARNING
    local g=(gluster --mode=script --glusterd-sock="$state/run/glusterd.socket")
    for _ in $(seq 100); do "${g[@]}" volume list >/dev/null 2>&1 && break; sleep 0.1; done
    for v in "${vols[@]}"; do
        "${g[@]}" volume create "$v" "$host:$state/bricks/$v" force >/dev/null
    done
    for o in stat-prefetch quick-read open-behind io-cache read-ahead readdir-ahead; do
        "${g[@]}" volume set kvstrict "performance.$o" off >/dev/null
    done
    for v in "${vols[@]}"; do "${g[@]}" volume start "$v" >/dev/null; done
    for m in "${mounts[@]}"; do
        mkdir -p "$state/mnt/$m"
        local opts=()
        if [[ $m == strict-* ]]; then
            opts=(--volfile-id=kvstrict --attribute-timeout=0 --entry-timeout=0 --negative-timeout=0 --fopen-keep-cache=false)
        else
            opts=(--volfile-id=kvdefault)
        fi
        glusterfs --process-name fuse --volfile-server="$host" "${opts[@]}" -p "$state/run/client-$m.pid" \
            -l "$state/logs/client-$m.log" "$state/mnt/$m"
    done
    for m in "${mounts[@]}"; do
        for _ in $(seq 100); do mountpoint -q "$state/mnt/$m" && stat -f "$state/mnt/$m" >/dev/null 2>&1 && break; sleep 0.1; done
        mountpoint -q "$state/mnt/$m" || { echo "mount $state/mnt/$m did not come up; see $state/logs/client-$m.log" >&2; exit 4; }
        echo "$m=$state/mnt/$m"
    done
    log "up: volumes ${vols[*]} on $host, mounted under $state/mnt"
}

case $cmd in
    up) up ;;
    down) down ;;
    *) echo "usage: glusterfs.sh up|down STATE_DIR" >&2; exit 2 ;;
esac
