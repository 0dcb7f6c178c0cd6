"""The key that opens a server's shared-memory and model-repository protocols, and where clients find it.

Why: through Triton's shared-memory protocol any client may register any file of /dev/shm, the Python backend's
own regions included, and have an answer written over it (Triton 2.51 then aborts); through the model-repository
protocol any client may load and unload models. The embedded server (mdtriton/server.py) therefore restricts both
protocols to requests that carry its key in a header (Triton's --grpc-restricted-protocol and
--http-restricted-api), and writes the key to a file only its user can read: KEY_DIRECTORY/grpc-PORT.key, PORT its
gRPC port. Our client sends the key of a local server it finds there, or the key in the file that
MDTRITON_SERVER_KEY_FILE names (any server: one started otherwise, with the same restricted-protocol flags).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

KEY_FILE_ENV = "MDTRITON_SERVER_KEY_FILE"
# Triton's restricted-protocol key: the HTTP header of that name, and for gRPC the metadata key with Triton's prefix.
RESTRICTED_KEY = "mdtriton-key"
GRPC_HEADER = f"triton-grpc-protocol-{RESTRICTED_KEY}"
RESTRICTED_PROTOCOLS = ("shared-memory", "model-repository")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_local(url: str) -> bool:
    """Whether url names this host by a loopback address (where shared memory can work)."""
    host = urlsplit(f"//{url}").hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def key_directory() -> Path:
    """Where embedded servers keep their keys: $XDG_RUNTIME_DIR/mdtriton/server-keys, else
    ~/.cache/mdtriton/server-keys (made 0700 by the server that writes there)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache"
    return Path(base) / "mdtriton" / "server-keys"


def key_file(grpc_port: int) -> Path:
    """The file in which the embedded server listening on grpc_port keeps its key."""
    return key_directory() / f"grpc-{grpc_port}.key"


def key_headers(url: str) -> dict[str, str]:
    """The gRPC headers that carry the key of the server at url: from the file MDTRITON_SERVER_KEY_FILE names, else
    for a local server from key_file(port); {} where there is none (the restricted protocols are then refused)."""
    named = os.environ.get(KEY_FILE_ENV)
    if named:
        path = Path(named)
    else:
        port = urlsplit(f"//{url}").port
        if not is_local(url) or port is None:
            return {}
        path = key_file(port)
        if not path.is_file():
            return {}
    try:
        key = path.read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read the server's key from {path} ({error.strerror}); it is the key file of "
                         f"{'$' + KEY_FILE_ENV if named else 'the embedded server at ' + url}") from None
    return {GRPC_HEADER: key}
