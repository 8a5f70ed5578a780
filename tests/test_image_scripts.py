"""The image's helper scripts, run here without Docker (issue 21, item 18): add-user.sh against a
stand-in /etc (stub getent/groupadd/useradd/usermod), the locks' hash the labels carry, and the CI
clean-up that unmounts before it removes."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUBS = {
    # getent DB KEY: the line whose name or ID is KEY; exit 1 (grep) when there is none, as getent's 2.
    "getent": 'awk -F: -v k="$2" \'$1 == k || $3 == k\' "$FAKE_ETC/$1" | head -1 | grep .',
    "groupadd": 'echo "$3:x:$2:" >> "$FAKE_ETC/group"; echo "groupadd $*" >> "$FAKE_ETC/calls"',
    # useradd --no-log-init --create-home --uid U --gid G --shell S NAME
    "useradd": 'echo "$9:x:$4:$6::/home/$9:/bin/bash" >> "$FAKE_ETC/passwd"; echo "useradd $*" >> "$FAKE_ETC/calls"',
    # usermod --gid G NAME
    "usermod": ('awk -F: -v OFS=: -v g="$2" -v n="$3" \'$1 == n {$4 = g} 1\' "$FAKE_ETC/passwd" > "$FAKE_ETC/p" '
                '&& mv "$FAKE_ETC/p" "$FAKE_ETC/passwd"; echo "usermod $*" >> "$FAKE_ETC/calls"'),
}


def add_user(tmp_path: Path, uid: int, gid: int, passwd: str, group: str) -> tuple[str, dict[str, str], str]:
    """(add-user's output, {user name: "uid:gid"} afterwards, the calls it made)."""
    etc, bin_dir = tmp_path / "etc", tmp_path / "bin"
    etc.mkdir(parents=True)
    bin_dir.mkdir()
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(group)
    (etc / "calls").write_text("")
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    p = subprocess.run(["sh", str(ROOT / "docker" / "add-user.sh"), str(uid), str(gid)], capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_ETC": str(etc)}, timeout=30)
    assert p.returncode == 0, p.stderr
    users = {f[0]: f"{f[2]}:{f[3]}" for f in (line.split(":") for line in (etc / "passwd").read_text().splitlines())}
    return p.stdout, users, (etc / "calls").read_text()


BASE_PASSWD = "root:x:0:0:root:/root:/bin/bash\n"
BASE_GROUP = "root:x:0:\nusers:x:100:\n"


def test_a_reused_user_gets_the_asked_group(tmp_path):
    """0:100 printed gid=0 (root's own group) and passed; now root's group is users (100)."""
    out, users, calls = add_user(tmp_path, 0, 100, BASE_PASSWD, BASE_GROUP)
    assert users["root"] == "0:100" and "usermod --gid 100 root" in calls
    assert "root's group was 0, now users (100)" in out and "the image's user is root (0), group users (100)" in out


def test_the_images_own_user_rebuilt_with_another_gid(tmp_path):
    out, users, _ = add_user(tmp_path, 1000, 100, BASE_PASSWD + "tuneledger:x:1000:1000::/home/tuneledger:/bin/bash\n",
                             BASE_GROUP + "tuneledger:x:1000:\n")
    assert users["tuneledger"] == "1000:100"


def test_new_ids_make_a_user_and_a_group_and_matching_ones_change_nothing(tmp_path):
    _, users, calls = add_user(tmp_path / "a", 4242, 4242, BASE_PASSWD + "tuneledger:x:1000:1000::/home/t:/bin/bash\n",
                               BASE_GROUP + "tuneledger:x:1000:\n")
    assert users["tuneledger-4242"] == "4242:4242" and "groupadd --gid 4242 tuneledger-4242" in calls
    _, users, calls = add_user(tmp_path / "b", 0, 0, BASE_PASSWD, BASE_GROUP)
    assert users["root"] == "0:0" and calls == ""


def lock_files(service: str) -> list[str]:
    text = (ROOT / "docker" / "lock-hash").read_text()
    return re.search(rf'^\s*{service}\) files="([^"]+)"', text, re.M)[1].split()


def test_the_locks_hash_is_sha256sum_of_the_lock_files_hashed_again(tmp_path):
    files = lock_files("trainer")
    listing = "".join(f"{hashlib.sha256((ROOT / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    got = subprocess.run([str(ROOT / "docker" / "lock-hash"), "trainer"], capture_output=True, text=True, check=True).stdout
    assert got.strip() == hashlib.sha256(listing.encode()).hexdigest()
    # The image's build record computes it on its copy (/tmp/lock, the same relative paths): the same.
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    again = subprocess.run(["sh", str(ROOT / "docker" / "lock-hash"), "trainer", str(tmp_path)], capture_output=True,
                           text=True, check=True).stdout
    assert again == got
    assert subprocess.run([str(ROOT / "docker" / "lock-hash"), "nope"], capture_output=True).returncode == 2


def test_the_images_copy_every_lock_the_hash_covers_where_the_hash_reads_it():
    """install.sh hashes /tmp/lock: each file lock-hash names must be COPY'd there at its own path,
    and the label must be declared, for label and build record to agree."""
    docker = (ROOT / "Dockerfile").read_text()
    copied = {f"{dest.removeprefix('/tmp/lock/')}{Path(src).name}" if dest.endswith("/") else src
              for line in re.findall(r"^COPY (.+)$", docker, re.M) for *srcs, dest in [line.split()] for src in srcs
              if dest.startswith("/tmp/lock/")}
    assert set(lock_files("trainer")) | {"docker/lock-hash"} <= copied, copied
    for dockerfile in ("Dockerfile", "Dockerfile.quant"):
        text = (ROOT / dockerfile).read_text()
        assert "ARG IMAGE_LOCKS_SHA256=" in text and 'io.tuneledger.locks.sha256="${IMAGE_LOCKS_SHA256}"' in text
    assert 'IMAGE_LOCKS_SHA256=${IMAGE_LOCKS_SHA256:-$(docker/lock-hash "$service")}' in (ROOT / "docker" / "build").read_text()
    compose = (ROOT / "docker-compose.yml").read_text()
    assert compose.count("IMAGE_LOCKS_SHA256: ${IMAGE_LOCKS_SHA256:-}") == 2  # trainer and quantize


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to bind-mount")
def test_the_ci_clean_up_unmounts_before_it_removes(tmp_path):
    """dockerd leaves exec/netns/default mounted: rm -rf said 'Device or resource busy' and left it."""
    work = tmp_path / "work"
    (work / "exec" / "netns").mkdir(parents=True)
    (work / "exec" / "netns" / "default").touch()
    (tmp_path / "ns").touch()
    if subprocess.run(["mount", "--bind", str(tmp_path / "ns"), str(work / "exec" / "netns" / "default")]).returncode:
        pytest.skip("bind mounts are not allowed here")
    try:
        assert subprocess.run(["rm", "-rf", str(work)], capture_output=True).returncode != 0  # the failure it fixes
        p = subprocess.run(["bash", str(ROOT / ".ci" / "rm-tree.sh"), str(work)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        assert not work.exists() and str(work) not in Path("/proc/self/mountinfo").read_text()
    finally:
        subprocess.run(["umount", "-l", str(work / "exec" / "netns" / "default")], capture_output=True)
