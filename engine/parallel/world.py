"""How a process joins the torch.distributed world of the driver and its stage ranks, on one host or several.

The driver (rank 0, in the engine process) hosts the rendezvous; each stage rank finds it through the standard
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or, launched by `torchrun`, through `--driver HOST:PORT`
(torchrun's own MASTER_PORT is its agent's store, and its ranks 0..W-1 are our stage ranks 1..W). Between hosts,
gloo must listen on the interface that reaches the driver, not on whatever the host name resolves to (often an
address of another network, or none): unless GLOO_SOCKET_IFNAME says otherwise, that interface is found by routing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# An idle server sends no frames for as long as nobody asks it anything: receives must not time out.
RENDEZVOUS_TIMEOUT = timedelta(days=365)
JOINED = "orcinus/joined/{}"  # the store key a stage rank sets as it joins
JOIN_POLL = 0.05  # seconds between the driver's looks at which ranks have joined
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class LinkLost(RuntimeError):
    """A peer's connection closed or broke (gloo's error, raised where a receive or a send met it)."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"lost the connection to rank {rank}: {str(error).splitlines()[0] if str(error) else error!r}")
        self.rank = rank


@dataclass(frozen=True)
class Place:
    """A process's seat in the world: its rank, the world's size, and where the driver's rendezvous listens."""

    rank: int
    world_size: int
    host: str
    port: int


def stage_place(driver: str | None = None, environ: dict[str, str] | None = None) -> Place:
    """A stage rank's place from its environment; `driver` ("HOST:PORT") overrides MASTER_ADDR and MASTER_PORT."""
    env = os.environ if environ is None else environ
    torchrun = "TORCHELASTIC_RUN_ID" in env
    if torchrun and driver is None:
        raise ValueError(
            "under torchrun, pass --driver HOST:PORT (the server's MASTER_ADDR:MASTER_PORT): torchrun's "
            "own MASTER_PORT is its agent's rendezvous, not the driver's"
        )
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if driver is not None:
            host, _, port = driver.rpartition(":")
            host = host.strip("[]")
        else:
            host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
        place = Place(rank + torchrun, world + torchrun, host, int(port))
    except KeyError as e:
        raise ValueError(f"a stage rank needs {e.args[0]} in its environment (or torchrun's)") from None
    if not 1 <= place.rank < place.world_size:
        raise ValueError(f"RANK {place.rank} is not a stage rank of a world of {place.world_size} (the driver is 0)")
    return place


def driver_place(world_size: int, environ: dict[str, str] | None = None) -> Place:
    """The driver's place when its ranks are started elsewhere: it listens on MASTER_ADDR:MASTER_PORT."""
    env = os.environ if environ is None else environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError("--external-stages needs MASTER_ADDR and MASTER_PORT: where the stage ranks reach this one")
    return Place(0, world_size, env["MASTER_ADDR"], int(env["MASTER_PORT"]))


def join(place: Place, check: Callable[[], None] | None = None) -> None:
    """Rendezvous with the rest of the world (blocks until every rank has come). While the driver waits for the
    ranks it calls `check`, which raises to give up (a rank it launched exited before it came)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_toward(place.host)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name  # read by gloo when the group is made, in this process only
    # The store torch's tcp:// rendezvous would make, but one whose server does not block until every rank has come:
    # a rank that died before it came would keep the driver waiting for the whole (year-long) timeout.
    driver = place.rank == 0
    store = dist.TCPStore(
        place.host,
        place.port,
        place.world_size,
        is_master=driver,
        timeout=RENDEZVOUS_TIMEOUT,
        wait_for_workers=False,
        multi_tenant=True,
    )
    if driver:
        joined = [JOINED.format(rank) for rank in range(1, place.world_size)]
        while not store.check(joined):
            if check is not None:
                check()
            time.sleep(JOIN_POLL)
    else:
        store.set(JOINED.format(place.rank), "")
    dist.init_process_group(
        "gloo", store=store, rank=place.rank, world_size=place.world_size, timeout=RENDEZVOUS_TIMEOUT
    )


def interface_toward(host: str) -> str | None:
    """The name of the local interface that routes to `host` (IPv4), or None: loopback, unknown, or not Linux."""
    try:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # no packet is sent: this only asks the kernel for a route
            local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == local:
                return name
    except OSError:
        pass
    return None


def _ipv4_of(name: str) -> str | None:
    import fcntl  # Linux and other Unixes only

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    return None
