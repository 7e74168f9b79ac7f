#!/usr/bin/env bash
# An S3 server on 127.0.0.1 for the object tier's tests and benchmarks: Ceph's RADOS gateway on a
# one-node Ceph (one monitor, one OSD of KVTIER_CEPH_OSD_BYTES, 1 GiB by default), all state in
# STATE_DIR with its own cluster config (nothing in /etc/ceph or /var/lib/ceph). The OSD is on
# memstore (in RAM) unless KVTIER_CEPH_OSD_STORE=bluestore: then on a sparse file in STATE_DIR, its
# cache held to 1 GiB (memstore takes about twice what it holds, more than a large benchmark's
# bucket leaves of this machine's memory beside its engines).
#
#   scripts/distfs/radosgw.sh up STATE_DIR     # prints ENDPOINT=, ACCESS_KEY=, SECRET_KEY=, PID=
#   scripts/distfs/radosgw.sh down STATE_DIR   # stops every daemon it started, removes STATE_DIR
#
# Its own ports (monitor KVTIER_CEPH_MON_PORT or 3301, gateway KVTIER_RGW_PORT or 7481), so it runs
# beside cephfs.sh's cluster (3300). Lifecycle rules run every KVTIER_RGW_LC_DAY_S seconds (5), and a
# lifecycle "day" lasts that long (for tests of expiry rules; 0: RGW's daily schedule). No manager: the gateway does not need one. Inside the cluster cephx is on, with
# every daemon's key in one keyring in STATE_DIR (radosgw 16.2 cannot join a cluster with cephx off:
# its monitor client fails with EACCES); S3 requests are signed with the gateway user's keys.
# Needs root (the daemons' default paths) and Debian's ceph-mon ceph-osd radosgw ceph-common.
set -euo pipefail
cmd=${1:?usage: radosgw.sh up|down STATE_DIR}
state=${2:?usage: radosgw.sh up|down STATE_DIR}
osd_bytes=${KVTIER_CEPH_OSD_BYTES:-1073741824}
osd_store=${KVTIER_CEPH_OSD_STORE:-memstore}
[[ $osd_store == memstore || $osd_store == bluestore ]] || { echo "KVTIER_CEPH_OSD_STORE=$osd_store: memstore or bluestore" >&2; exit 2; }
rgw_port=${KVTIER_RGW_PORT:-7481}
mon_port=${KVTIER_CEPH_MON_PORT:-3301}
# A lifecycle "day" in seconds (RGW's rgw_lc_debug_interval; also lifts the daily work-time window),
# so that the tests can see an expiry rule act: a rule of 1 day expires objects after this long.
lc_day_s=${KVTIER_RGW_LC_DAY_S:-5}
mounts=()
daemons=(client.rgw.a osd.0 mon.a)
log() { printf '[radosgw %s] %s\n' "$(date +%T)" "$*" >&2; }

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

down() {
    set +e # tear down as much as possible, whatever fails
    [[ -d $state ]] || return 0
    stop_ceph_daemons
    rm -rf "$state"
    log "down: $state removed"
}

write_conf() {
    cat >"$1" <<CONF
[global]
fsid = $2
mon host = v2:127.0.0.1:$mon_port
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $state/keyring
run dir = $state/run
pid file = $state/run/\$name.pid
admin socket = $state/run/\$name.asok
log file = $state/logs/\$name.log
debug ms = 0
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
[mon]
mon data = $state/mon/\$name
mon cluster log file = $state/logs/cluster.log
[osd]
osd data = $state/osd/\$name
osd objectstore = $osd_store
memstore device bytes = $osd_bytes
osd journal size = 100
bluestore block create = true
bluestore block size = $osd_bytes
bluestore fsck on mount = false
osd memory target = 1073741824
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $state/rgw
rgw dns name = 127.0.0.1
rgw enable usage log = false
rgw lc debug interval = $lc_day_s
CONF
}

make_keyring() { # every entity's key, imported by the monitor at --mkfs
    local k=$1
    ceph-authtool --create-keyring "$k" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$k" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
    ceph-authtool "$k" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' >/dev/null
    ceph-authtool "$k" --gen-key -n client.rgw.a --cap mon 'allow rw' --cap osd 'allow rwx' >/dev/null
    chmod 600 "$k"
}

up() {
    [[ $(id -u) -eq 0 ]] || { echo "radosgw.sh needs root (the Ceph daemons)" >&2; exit 3; }
    local missing=()
    for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool ceph-authtool; do command -v $b >/dev/null || missing+=("$b"); done
    ((${#missing[@]} == 0)) || { echo "missing ${missing[*]}: apt-get install ceph-mon ceph-osd radosgw ceph-common (scripts/setup.sh does as root)" >&2; exit 3; }
    down
    set -e
    mkdir -p "$state"/{mon,osd,rgw,logs,run}
    local fsid conf=$state/ceph.conf
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$conf" "$fsid"
    local c=(ceph -c "$conf" --connect-timeout 30)
    make_keyring "$state/keyring"
    monmaptool --create --clobber --addv a "[v2:127.0.0.1:$mon_port]" --fsid "$fsid" "$state/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$state/monmap" --keyring "$state/keyring" >/dev/null
    ceph-mon -c "$conf" -i a >>"$state/logs/daemons.out" 2>&1
    log "mon started"
    local osd_id
    osd_id=$("${c[@]}" osd create)
    [[ $osd_id == 0 ]] || { echo "unexpected OSD id $osd_id" >&2; exit 4; }
    mkdir -p "$state/osd/osd.0"
    ceph-osd -c "$conf" -i 0 --mkfs >"$state/logs/osd-mkfs.log" 2>&1 || { echo "ceph-osd --mkfs failed; see $state/logs/osd-mkfs.log" >&2; exit 4; }
    ceph-osd -c "$conf" -i 0 >>"$state/logs/daemons.out" 2>&1
    "${c[@]}" osd crush add osd.0 1.0 host=localhost root=default >/dev/null 2>&1 || true
    log "osd started"
    radosgw -c "$conf" -n client.rgw.a >>"$state/logs/daemons.out" 2>&1
    local ok=0
    for _ in $(seq 600); do
        curl -s -o /dev/null "http://127.0.0.1:$rgw_port/" && { ok=1; break; }
        sleep 0.2
    done
    ((ok)) || { echo "radosgw never answered on 127.0.0.1:$rgw_port; see $state/logs" >&2; exit 4; }
    log "radosgw answers on 127.0.0.1:$rgw_port"
    local user
    user=$(radosgw-admin -c "$conf" user create --uid=kvtier --display-name=kvtier 2>>"$state/logs/admin.log")
    python3 - "$user" "$rgw_port" "$(cat "$state/run/client.rgw.a.pid")" <<'PY'
import json, sys
key = json.loads(sys.argv[1])["keys"][0]
print(f"ENDPOINT=http://127.0.0.1:{sys.argv[2]}")
print(f"ACCESS_KEY={key['access_key']}")
print(f"SECRET_KEY={key['secret_key']}")
print(f"PID={sys.argv[3]}")
PY
    log "up: user kvtier created"
}

case $cmd in
    up) up ;;
    down) down ;;
    *) echo "usage: radosgw.sh up|down STATE_DIR" >&2; exit 2 ;;
esac
