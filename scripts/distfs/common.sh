# Teardown helpers shared by glusterfs.sh, cephfs.sh and radosgw.sh (sourced; they use the caller's
# $state, $mounts, $daemons and log).

alive() { # alive PID: running and not a zombie (daemons reparented to a non-reaping parent linger as Z)
    local st
    st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z ]]
}

kill_pidfile() { # kill_pidfile FILE: TERM, then KILL after 5 s, the process whose id FILE holds
    local f=$1 pid
    pid=$(cat "$f" 2>/dev/null) || return 0  # a client removes its own pid file when unmounted
    [[ -n $pid ]] || return 0
    if alive "$pid"; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$f"
}

sweep_state_processes() { # SIGKILL any process left whose command line names $state (ours only)
    local p cmd
    for p in /proc/[0-9]*; do
        cmd=$({ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null) || continue
        [[ $cmd == *"$state/"* ]] || continue
        alive "${p#/proc/}" && kill -9 "${p#/proc/}" 2>/dev/null
    done
    return 0
}

unmount_all() { # every FUSE mount of $state, even one with I/O stuck in it, and its client
    for m in "${mounts[@]}"; do
        if grep -q " $state/mnt/$m " /proc/mounts; then # (mountpoint itself hangs on a stuck mount)
            # A mount with I/O stuck in it (a full or stopped Ceph OSD blocks writes) hangs umount in
            # the kernel, beyond any signal: after 10 s kill its FUSE client (which fails the stuck
            # requests and releases umount), then detach it lazily.
            umount "$state/mnt/$m" 2>/dev/null &
            local waiter=$!
            for _ in $(seq 100); do alive "$waiter" || break; sleep 0.1; done
            if alive "$waiter" || grep -q " $state/mnt/$m " /proc/mounts; then
                pid=$(cat "$state/run/client-$m.pid" 2>/dev/null) && kill -9 "$pid" 2>/dev/null
                sleep 0.5
                umount -l "$state/mnt/$m" 2>/dev/null
                grep -q " $state/mnt/$m " /proc/mounts && log "could not detach $state/mnt/$m: umount -l it by hand"
            fi
            wait "$waiter" 2>/dev/null
        fi
        kill_pidfile "$state/run/client-$m.pid"
    done
}

stop_ceph_daemons() { # SIGKILL every one of $daemons by its pid file in $state/run, then whatever is left
    # SIGKILL: the state is thrown away, and an MDS stopped with SIGTERM may respawn itself (a new
    # process, no longer in its pid file).
    local d pid
    for d in "${daemons[@]}"; do
        pid=$(cat "$state/run/$d.pid" 2>/dev/null) && kill -9 "$pid" 2>/dev/null
        rm -f "$state/run/$d.pid"
    done
    for _ in 1 2 3; do sweep_state_processes; sleep 0.2; done
}
