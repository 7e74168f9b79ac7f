#!/usr/bin/env bash
# CephFS on 127.0.0.1 for the shared-tier tests and benchmarks: one monitor, one manager, one OSD
# (memstore: in RAM, KVTIER_CEPH_OSD_BYTES, 2 GiB by default) and one MDS, all with their state in
# STATE_DIR and their own cluster config (nothing in /etc/ceph or /var/lib/ceph); the file system is
# mounted four times with ceph-fuse (two "nodes" per caching mode).
#
#   scripts/distfs/cephfs.sh up STATE_DIR     # prints the four mount points, NAME=PATH
#   scripts/distfs/cephfs.sh down STATE_DIR   # unmounts, stops every daemon it started, removes STATE_DIR
#
# Mounts:
#   default-a, default-b: ceph-fuse defaults (kernel page cache on, object cacher on).
#   strict-a, strict-b:   --fuse_disable_pagecache=true --client_oc=false (no client-side data cache).
# Cluster settings the tier needs: "mds early reply = false" (with it, the MDS delays another client's
# open of a just-renamed file by up to 5 s); a running mgr (without one statvfs reports 0 bytes).
# Authentication is off (cephx none): the cluster listens on 127.0.0.1 only and lives for one test
# session. Needs root, /dev/fuse and Debian's ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse.
# Ports 3300 and 6789 must be free (one instance per machine).
set -euo pipefail
cmd=${1:?usage: cephfs.sh up|down STATE_DIR}
state=${2:?usage: cephfs.sh up|down STATE_DIR}
osd_bytes=${KVTIER_CEPH_OSD_BYTES:-2147483648}
mounts=(default-a default-b strict-a strict-b)
daemons=(mds.a osd.0 mgr.x mon.a)
log() { printf '[cephfs %s] %s\n' "$(date +%T)" "$*" >&2; }

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

down() {
    set +e # tear down as much as possible, whatever fails
    [[ -d $state ]] || return 0
    unmount_all
    stop_ceph_daemons
    rm -rf "$state"
    log "down: $state removed"
}

up() {
    [[ $(id -u) -eq 0 ]] || { echo "cephfs.sh needs root (FUSE mounts)" >&2; exit 3; }
    local missing=()
    for b in ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph monmaptool; do command -v $b >/dev/null || missing+=("$b"); done
    ((${#missing[@]} == 0)) || { echo "missing ${missing[*]}: apt-get install ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common (scripts/setup.sh does as root)" >&2; exit 3; }
    [[ -c /dev/fuse ]] || { echo "/dev/fuse missing: load the fuse module or run the container with --device /dev/fuse" >&2; exit 3; }
    down
    set -e
    mkdir -p "$state"/{mon,osd,mds,mgr,mnt,logs,run}
    local fsid conf=$state/ceph.conf
    fsid=$(cat /proc/sys/kernel/random/uuid)
    cat >"$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:3300
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = $state/run
pid file = $state/run/\$name.pid
admin socket = $state/run/\$name.asok
log file = $state/logs/\$name.log
debug ms = 0
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
osd crush chooseleaf type = 0
mon warn on pool no redundancy = false
[mon]
mon data = $state/mon/\$name
mon cluster log file = $state/logs/cluster.log
[mgr]
mgr data = $state/mgr/\$name
mgr initial modules = status
[osd]
osd data = $state/osd/\$name
osd objectstore = memstore
memstore device bytes = $osd_bytes
osd journal size = 100
[mds]
mds data = $state/mds/\$name
mds early reply = false
[client]
client mount timeout = 30
CONF
    local c=(ceph -c "$conf" --connect-timeout 30)
    monmaptool --create --clobber --addv a "[v2:127.0.0.1:3300]" --fsid "$fsid" "$state/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$state/monmap" >/dev/null
    ceph-mon -c "$conf" -i a >>"$state/logs/daemons.out" 2>&1
    log "mon started"
    mkdir -p "$state/mgr/mgr.x"
    # KVTIER_CEPH_NO_MGR=1: no manager (statvfs then reads 0 bytes; for measuring that, not for tests).
    [[ ${KVTIER_CEPH_NO_MGR:-0} == 1 ]] || ceph-mgr -c "$conf" -i x >>"$state/logs/daemons.out" 2>&1
    local osd_id
    osd_id=$("${c[@]}" osd create)
    [[ $osd_id == 0 ]] || { echo "unexpected OSD id $osd_id" >&2; exit 4; }
    mkdir -p "$state/osd/osd.0" "$state/mgr/mgr.x"
    ceph-osd -c "$conf" -i 0 --mkfs >"$state/logs/osd-mkfs.log" 2>&1 || { echo "ceph-osd --mkfs failed; see $state/logs/osd-mkfs.log" >&2; exit 4; }
    ceph-osd -c "$conf" -i 0 >>"$state/logs/daemons.out" 2>&1
    "${c[@]}" osd crush add osd.0 1.0 host=localhost root=default >/dev/null 2>&1 || true
    log "osd started"
    "${c[@]}" osd pool create cephfs_data 8 >/dev/null 2>&1
    "${c[@]}" osd pool create cephfs_metadata 8 >/dev/null 2>&1
    "${c[@]}" fs new cephfs cephfs_metadata cephfs_data >/dev/null 2>&1
    mkdir -p "$state/mds/mds.a"
    ceph-mds -c "$conf" -i a >>"$state/logs/daemons.out" 2>&1
    for _ in $(seq 600); do
        "${c[@]}" mds stat 2>/dev/null | grep -q "up:active" && break
        sleep 0.2
    done
    "${c[@]}" mds stat 2>/dev/null | grep -q "up:active" || { echo "the MDS never became active; see $state/logs" >&2; exit 4; }
    log "mds active"
    for m in "${mounts[@]}"; do
        mkdir -p "$state/mnt/$m"
        local opts=()
        [[ $m == strict-* ]] && opts=(--fuse_disable_pagecache=true --client_oc=false)
        ceph-fuse -c "$conf" "${opts[@]}" --pid-file "$state/run/client-$m.pid" --log-file "$state/logs/client-$m.log" \
            --admin-socket "$state/run/client-$m.asok" "$state/mnt/$m" >/dev/null 2>&1
    done
    for m in "${mounts[@]}"; do
        for _ in $(seq 300); do mountpoint -q "$state/mnt/$m" && break; sleep 0.1; done
        mountpoint -q "$state/mnt/$m" || { echo "mount $state/mnt/$m did not come up; see $state/logs/client-$m.log" >&2; exit 4; }
        echo "$m=$state/mnt/$m"
    done
    log "up: CephFS mounted under $state/mnt"
}

case $cmd in
    up) up ;;
    down) down ;;
    *) echo "usage: cephfs.sh up|down STATE_DIR" >&2; exit 2 ;;
esac
