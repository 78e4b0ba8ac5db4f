"""The webhook's serving certificate, reloaded from its files when they change.

Kubernetes rotates a mounted Secret by swapping a symlink (``..data``), and
cert-manager renews certificates weeks before they expire; a webhook that read
its key pair once would serve an expired certificate until someone restarted
it. The files are polled with ``os.stat`` (following symlinks, so a swapped
``..data`` link is seen). A changed pair is loaded into a new
:class:`ssl.SSLContext`, which replaces the serving one in one assignment; the
listening context hands each handshake the serving context from its SNI callback
(called for every ClientHello, with or without a server name). Loading into the
live context instead would let a handshake start between its certificate and its
key and fail with the new certificate and the old key. A pair that does not load
(half-written, key and certificate mismatched) is logged and the previous one is
kept.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from kubegpu.httpserve import CertificateError, harden, load_pair

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Stamp:
    cert: tuple[int, int, int, int]
    key: tuple[int, int, int, int]


def _stamp(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns


def _new_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    harden(ctx)  # TLS >= 1.2, AEAD suites only
    return ctx


def certificate_not_after(cert_file: str) -> dt.datetime:
    with open(cert_file, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).not_valid_after_utc


class CertReloader:
    """Owns the listening context; :meth:`check` swaps in a new serving context when the files changed."""

    def __init__(self, cert_file: str, key_file: str,
                 on_reload: Callable[[bool, str], None] | None = None) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._on_reload = on_reload
        # The first pair serves and is the one the server listens with; it is never loaded into again.
        self.context = self._serving = _new_context()
        load_pair(self.context, cert_file, key_file)  # a bad pair at start is fatal: CertificateError
        self.context.sni_callback = self._serve_current
        try:
            self.not_after = certificate_not_after(cert_file)
        except (OSError, ValueError) as e:
            raise CertificateError(f"cannot read the certificate {cert_file}: {e}") from None
        self._stamp = self._read_stamp()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_stamp(self) -> _Stamp | None:
        try:
            return _Stamp(_stamp(self.cert_file), _stamp(self.key_file))
        except OSError:
            return None

    def check(self) -> bool:
        """Reload when the files changed since the last load; True when a new pair is now served."""
        with self._lock:
            stamp = self._read_stamp()
            if stamp is None or stamp == self._stamp:
                return False
            try:
                fresh = _new_context()
                fresh.load_cert_chain(self.cert_file, self.key_file)
                self.not_after = certificate_not_after(self.cert_file)
            except (OSError, ssl.SSLError, ValueError) as exc:
                # Keep polling: the writer may be half-way through; the next change retries.
                log.warning("serving certificate %s not reloaded, keeping the previous one: %s",
                            self.cert_file, exc)
                self._stamp = stamp
                if self._on_reload:
                    self._on_reload(False, str(exc))
                return False
            self._serving = fresh
            self._stamp = stamp
            log.info("serving certificate reloaded from %s (valid until %s)", self.cert_file, self.not_after)
            if self._on_reload:
                self._on_reload(True, "")
            return True

    def _serve_current(self, conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None,
                       _listening: ssl.SSLContext) -> None:
        conn.context = self._serving

    def start(self, poll_s: float) -> None:
        """Poll in a daemon thread every ``poll_s`` seconds until :meth:`stop`."""
        def loop() -> None:
            while not self._stop.wait(poll_s):
                self.check()

        self._thread = threading.Thread(target=loop, name="cert-reloader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
