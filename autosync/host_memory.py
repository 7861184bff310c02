"""The memory this machine gives its processes (the ``local`` cluster's and the testbed's)."""
from __future__ import annotations

import os

# a container's memory limit: cgroup v2, then v1 ("max" or a huge number where there is none)
CGROUP_MEMORY_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory_gib(cgroup_files=CGROUP_MEMORY_FILES) -> float | None:
    """The memory this machine gives its processes, in GiB: its physical memory, or its control
    group's limit where lower (a container's); None where the system does not say."""
    try:
        nbytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for path in cgroup_files:
        try:
            with open(path) as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < nbytes:
            nbytes = int(text)
    return nbytes / 2**30 if nbytes > 0 else None
