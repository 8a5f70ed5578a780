#!/bin/sh
# The image's entrypoint: pick the GPUs, make sure the folders the command writes are writable,
# then run the command.
#   GPUS=all (default) uses every GPU the container was given; GPUS=0,1 uses those (CUDA_VISIBLE_DEVICES),
#   so `tuneledger train` starts one rank per listed GPU.
#   TUNELEDGER_WRITES="runs .cache": folders under /workspace that must be writable (compose sets
#   it per service; empty: no check).
#   TUNELEDGER_UID / TUNELEDGER_GID: when the container starts as root with these set (the monitor
#   service), the command runs as that user (setpriv), and a folder that is empty and owned by root
#   is first given to that user: Docker creates a missing bind-mount folder as root, so a fresh
#   checkout's `docker compose up -d monitor` meets exactly that.
#   TUNELEDGER_BACKOFF_S: on a folder it cannot fix, wait this long before exiting (default 0), so
#   that a restart policy retries once a minute instead of in a tight loop.
# A folder it cannot fix gets one message naming the folder, its owner, the user and the commands
# that fix it; the exit code is then 78 (EX_CONFIG).
set -e
case "${GPUS:-all}" in
    all) ;;
    *) CUDA_VISIBLE_DEVICES="$GPUS"; export CUDA_VISIBLE_DEVICES ;;
esac

me=$(id -u):$(id -g)
as=
if [ "$(id -u)" = 0 ] && [ -n "${TUNELEDGER_UID:-}" ]; then
    me=$TUNELEDGER_UID:${TUNELEDGER_GID:-$TUNELEDGER_UID}
    [ "$me" = 0:0 ] || as="setpriv --reuid=${me%:*} --regid=${me#*:} --clear-groups --"
fi
# Container root is not host root under rootless Docker or userns-remap: uid_map is not the identity.
userns=$(awk '$1 == 0 && $2 != 0 { print 1 }' /proc/self/uid_map 2>/dev/null)

setting() {  # the .env setting that names a folder's host side
    case "$1" in runs) echo RUNS_DIR ;; models) echo MODELS_DIR ;; .cache) echo CACHE_DIR ;; data) echo DATA_DIR ;; *) echo "$1" ;; esac
}
bad=
for d in ${TUNELEDGER_WRITES:-}; do
    path=/workspace/$d
    [ -d "$path" ] || continue
    $as test -w "$path" && continue
    owner=$(stat -c %u:%g "$path")
    if [ -n "$as" ] && [ "$owner" = 0:0 ] && [ -z "$(ls -A "$path")" ] && [ -z "$userns" ]; then
        chown "$me" "$path"
        echo "tuneledger-entrypoint: $d/ was empty and owned by root (Docker creates a missing folder so): given to $me, the user this service runs as" >&2
        continue
    fi
    var=$(setting "$d")
    {
        echo "tuneledger-entrypoint: cannot write to $d/ (on the host: \$$var, default ./$d): it belongs to $owner and this container runs as $me."
        if [ -n "$userns" ]; then
            echo "  Rootless Docker (or userns-remap): container root is you on the host. Set HOST_UID=0 and HOST_GID=0 in .env."
        else
            echo "  Either run the services as the folder's owner: set HOST_UID=${owner%:*} and HOST_GID=${owner#*:} in .env"
            echo "  or give the folder to $me, on the host:  sudo chown -R $me ${d}"
        fi
    } >&2
    bad=1
done
if [ -n "$bad" ]; then
    if [ "${TUNELEDGER_BACKOFF_S:-0}" -gt 0 ]; then
        echo "tuneledger-entrypoint: retrying in ${TUNELEDGER_BACKOFF_S} s (the restart policy starts it again)" >&2
        sleep "$TUNELEDGER_BACKOFF_S"
    fi
    exit 78
fi
exec $as "$@"
