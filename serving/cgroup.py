"""The memory limit the kernel holds this process to: the tightest `memory.max` (cgroup v2) or
`memory.limit_in_bytes` (cgroup v1) of the cgroups it is in, up to the root of each mounted hierarchy.

A container's limit (Docker's `--memory`, a Kubernetes container's `resources.limits.memory`) is one of these. The
cgroup a process is in comes from `/proc/self/cgroup` (`id:controllers:path`), where each hierarchy is mounted from
`/proc/self/mountinfo` (its root within the hierarchy and its mount point): with a cgroup namespace the process's
own cgroup is the mount's root; without one, the path names it below the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["MemoryLimit", "memory_limit"]

# cgroup v1 writes "no limit" as the largest page-aligned counter (9223372036854771712 with 4 KiB pages).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: Path  # the file that says it


@dataclass(frozen=True)
class _Mount:
    root: str
    point: Path
    fstype: str
    options: frozenset[str]


def _mounts(mountinfo: str) -> list[_Mount]:
    mounts = []
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if not sep or len(parts) < 5 or len(tail) < 3:
            continue
        options = frozenset(tail[2].split(","))
        mounts.append(_Mount(parts[3], Path(parts[4].replace("\\040", " ")), tail[0], options))
    return mounts


def _read_limit(path: Path, unlimited: str) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == unlimited or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _tightest(mount: _Mount, cgroup: str, name: str, unlimited: str) -> MemoryLimit | None:
    """The smallest limit on the way from the process's cgroup up to the mount point."""
    path, root = PurePosixPath(cgroup), PurePosixPath(mount.root)
    start = mount.point / path.relative_to(root) if path.is_relative_to(root) else mount.point
    if not start.is_dir():
        start = mount.point  # a path of another namespace: the mount is the process's own cgroup
    found: MemoryLimit | None = None
    directory = start
    while True:
        value = _read_limit(directory / name, unlimited)
        if value is not None and (found is None or value < found.bytes):
            found = MemoryLimit(value, directory / name)
        if directory == mount.point or directory.parent == directory:
            return found
        directory = directory.parent


def memory_limit(proc_self: Path = Path("/proc/self")) -> MemoryLimit | None:
    """The tightest memory limit of this process's cgroups (v2 and v1 alike), or None when nothing limits it or
    the files cannot be read."""
    try:
        cgroups = (proc_self / "cgroup").read_text(encoding="utf-8")
        mounts = _mounts((proc_self / "mountinfo").read_text(encoding="utf-8"))
    except OSError:
        return None
    found: list[MemoryLimit] = []
    for line in cgroups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            candidates = [(m, "memory.max", "max") for m in mounts if m.fstype == "cgroup2"]
        elif "memory" in controllers.split(","):
            candidates = [
                (m, "memory.limit_in_bytes", "") for m in mounts if m.fstype == "cgroup" and "memory" in m.options
            ]
        else:
            continue
        for mount, name, unlimited in candidates:
            limit = _tightest(mount, path, name, unlimited)
            if limit is not None:
                found.append(limit)
    return min(found, key=lambda limit: limit.bytes, default=None)
