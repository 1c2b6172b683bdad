"""A process's resident memory, split into its own pages and the shared-memory pages it has touched.

The channel rings are shared memory: each page counts in a process's RSS from the first time that process
reads or writes it, so RSS climbs until the stream has passed once through the whole ring (two 4 MiB rings),
then stays flat. That climb is not a leak; growth of the private part would be.
"""

from __future__ import annotations

from typing import NamedTuple


class Memory(NamedTuple):
    resident_bytes: int  # VmRSS
    shared_bytes: int  # RssShmem: shared-memory pages (the rings) in that figure

    @property
    def private_bytes(self) -> int:
        return self.resident_bytes - self.shared_bytes


def this_process() -> Memory | None:
    """From /proc/self/status; None where there is none (not Linux)."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssShmem"):
                    fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return Memory(fields.get("VmRSS", 0), fields.get("RssShmem", 0)) if "VmRSS" in fields else None
