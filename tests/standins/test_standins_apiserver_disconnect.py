"""The stand-in API server and a client that goes away mid-request: no error, no traceback (the demo's quiet
mode once printed one when a node daemon stopped while its ResourceSlice update was on the wire)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from polling import until

from kubegpu_standins.apiserver import ApiServer


def test_a_client_gone_before_its_body_arrives_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    with ApiServer() as api, caplog.at_level(logging.DEBUG, logger="kubegpu_standins.apiserver"):
        with socket.create_connection(("127.0.0.1", api.port)) as s:
            s.sendall(b"PUT /apis/resource.k8s.io/v1/resourceslices/x HTTP/1.1\r\nHost: a\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"a\":")
            time.sleep(0.2)  # the handler is reading the body when the client leaves
        assert until(lambda: any("client disconnected" in r.getMessage() for r in caplog.records), 10, 0.02)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
