#!/bin/sh
# The image's user, for any HOST_UID/HOST_GID: add-user.sh UID GID (run by the Dockerfiles as root).
#   A GID the base already has (0 root, 100 users, ...) is reused, else group `tuneledger` is made.
#   A UID the base already has (0 root, a base's own user such as ubuntu 1000) is reused, with that
#   group made its primary group when it was another (root for 0:100 gets group users): else the
#   image's user would say GID 0 where HOST_GID asked 100. Otherwise user `tuneledger` is made,
#   with a home, in that group. (tuneledger-<ID> where the name is taken.)
# Compose runs the containers as HOST_UID:HOST_GID whatever the names; this gives the IDs a name and
# /workspace an owner. Prints what it settled on.
set -eu
uid=${1:?usage: add-user.sh UID GID} gid=${2:?usage: add-user.sh UID GID}
group=$(getent group "$gid" | cut -d: -f1)
if [ -n "$group" ]; then
    echo "add-user: GID $gid exists in the base: group $group"
else
    group=tuneledger
    getent group "$group" >/dev/null && group=tuneledger-$gid  # the name taken by another GID
    groupadd --gid "$gid" "$group"
fi
user=$(getent passwd "$uid" | cut -d: -f1)
if [ -n "$user" ]; then
    echo "add-user: UID $uid exists in the base: user $user"
    had=$(getent passwd "$uid" | cut -d: -f4)
    if [ "$had" != "$gid" ]; then
        usermod --gid "$gid" "$user"
        echo "add-user: $user's group was $had, now $group ($gid)"
    fi
else
    # --no-log-init: a large UID would otherwise grow /var/log/lastlog to gigabytes.
    user=tuneledger
    getent passwd "$user" >/dev/null && user=tuneledger-$uid  # the name taken by another UID
    useradd --no-log-init --create-home --uid "$uid" --gid "$gid" --shell /bin/bash "$user"
fi
echo "add-user: the image's user is $user ($uid), group $group ($gid)"
