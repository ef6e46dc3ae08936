"""The devstack's readiness check asks the process it started, not whatever answers on the port:
a port found free when a stack was planned may serve someone else by the time the service starts."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenbus.infra.devstack.processes import serves


def health_server(body: dict) -> ThreadingHTTPServer:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_health_check_passes_only_for_the_process_that_answers():
    mine, other, silent = (health_server({"status": "ok", "pid": os.getpid()}),
                           health_server({"status": "ok", "pid": os.getpid() + 1}), health_server({"status": "ok"}))
    try:
        url = "http://127.0.0.1:{}/healthz"
        assert serves(url.format(mine.server_address[1]), os.getpid())
        assert not serves(url.format(other.server_address[1]), os.getpid())
        assert not serves(url.format(silent.server_address[1]), os.getpid())
        mine.shutdown()
        mine.server_close()
        assert not serves(url.format(mine.server_address[1]), os.getpid())  # nobody there
    finally:
        for server in (other, silent):
            server.shutdown()
            server.server_close()
