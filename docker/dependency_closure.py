"""The distributions that requirements pull in on this interpreter, read from the installed distributions' metadata
(extras and environment markers followed).

`python docker/dependency_closure.py EXTRAS` prints `name==version` of every distribution that `mmgate[EXTRAS]`
(`mmgate` when EXTRAS is empty) pulls in, less mmgate itself and torch, sorted by canonical name: what
docker/lock.sh writes into a lock file. It needs `packaging` installed beside mmgate.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(requirements: Iterable[str]) -> dict[str, metadata.Distribution]:
    """Canonical name -> installed distribution, for these requirements and everything they pull in."""
    seen: set[tuple[str, frozenset[str]]] = set()
    found: dict[str, metadata.Distribution] = {}
    stack = [Requirement(text) for text in requirements]
    while stack:
        req = stack.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)
        found[key[0]] = dist
        extras = req.extras or {""}
        for text in dist.requires or []:
            dependency = Requirement(text)
            if dependency.marker is None or any(dependency.marker.evaluate({"extra": extra}) for extra in extras):
                stack.append(dependency)
    return found


def pins(extras: str) -> list[str]:
    """The lock file's lines for `mmgate[extras]`."""
    found = closure([f"mmgate[{extras}]" if extras else "mmgate"])
    return [
        f"{found[name].metadata['Name']}=={found[name].version}"
        for name in sorted(found)
        if name not in {"mmgate", "torch"}
    ]


if __name__ == "__main__":
    for line in pins(sys.argv[1]):
        print(line)
