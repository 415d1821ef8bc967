"""serving/cgroup.py: the memory limit read as the kernel lays the files out, on cgroup v2 (a container with its own
cgroup namespace, and a host path without one) and v1 (limits up the hierarchy, the tightest one counts). The
gateway's check against a real cgroup of this machine is tests/gateway/test_memory_fit.py."""

from __future__ import annotations

from pathlib import Path

from serving.cgroup import MemoryLimit, memory_limit

V2_MOUNT = "30 24 0:26 {root} /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"


def layout(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A /proc/self (cgroup, mountinfo with the mount points moved under tmp_path) and the cgroup files."""
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo.replace(" /sys/fs/cgroup", f" {tmp_path}/sys/fs/cgroup"))
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


def test_v2_in_a_container_with_its_own_namespace(tmp_path: Path) -> None:
    proc = layout(tmp_path, "0::/\n", V2_MOUNT.format(root="/"), {"/sys/fs/cgroup/memory.max": "4294967296\n"})
    assert memory_limit(proc) == MemoryLimit(4 << 30, tmp_path / "sys/fs/cgroup/memory.max")


def test_v2_without_a_namespace_takes_the_tightest_limit_up_the_tree(tmp_path: Path) -> None:
    proc = layout(
        tmp_path,
        "0::/kubepods/burstable/pod1/ctr\n",
        V2_MOUNT.format(root="/"),
        {
            "/sys/fs/cgroup/kubepods/burstable/pod1/ctr/memory.max": "max\n",
            "/sys/fs/cgroup/kubepods/burstable/pod1/memory.max": "6442450944\n",
            "/sys/fs/cgroup/kubepods/burstable/memory.max": "max\n",
        },
    )
    limit = memory_limit(proc)
    assert limit is not None
    assert (limit.bytes, limit.source.parent.name) == (6 << 30, "pod1")


def test_v1_memory_controller_and_its_unlimited_value(tmp_path: Path) -> None:
    cgroups = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    files = {
        "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "2147483648\n",
        "/sys/fs/cgroup/memory/docker/memory.limit_in_bytes": "9223372036854771712\n",
    }
    proc = layout(tmp_path, cgroups, V1_MOUNT.format(root="/"), files)
    assert memory_limit(proc) == MemoryLimit(
        2 << 30, tmp_path / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"
    )
    unlimited = layout(
        tmp_path / "u",
        cgroups,
        V1_MOUNT.format(root="/docker/abc"),
        {
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    assert memory_limit(unlimited) is None


def test_nothing_to_read_is_no_limit(tmp_path: Path) -> None:
    assert memory_limit(tmp_path / "absent") is None
    proc = layout(tmp_path, "0::/\n", "", {})
    assert memory_limit(proc) is None
