#!/usr/bin/env bash
# rm-tree.sh DIR: unmount every mount at or under DIR, deepest first, then remove DIR.
# dockerd leaves mounts under its exec root (exec/netns/default is a bind mount of a network
# namespace); a plain rm -rf of the CI's scratch folder met "Device or resource busy" on it and left
# the folder behind. A mount that is still busy is detached lazily (umount -l) and goes when freed.
set -u
dir=$(realpath -m "${1:?usage: rm-tree.sh DIR}")
# /proc/self/mountinfo's 5th field is the mount point (blanks escaped as \040: none in mktemp names).
awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r \
    | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
rm -rf "$dir"
