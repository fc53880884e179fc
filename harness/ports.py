"""A free TCP port on 127.0.0.1 for a server or a torchrun rendezvous a test starts.

The kernel picks it (bind to port 0), so tests running side by side (pytest-xdist workers, two
checkouts on one machine) never meet on one port, as a port derived from the process id could.
The socket is closed before the caller binds: another process could take the port in between,
which the kernel makes unlikely (it does not hand a just-freed ephemeral port out again at once).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
