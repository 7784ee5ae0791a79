"""How a command reaches a listener that asks for a token or speaks TLS.

- ``--token-file PATH``: the bearer token (the file's first line), else the
  file that ``$EVENTPLANE_ADMIN_TOKEN_FILE`` names for the admin commands, or
  ``$EVENTPLANE_TOKEN_FILE`` for ``eventplane send``. A token is never taken
  on the command line, where ``ps`` shows it to everyone.
- ``--ca-file PATH``: the CA that signed the listener's certificate (a private
  CA); default: the system's CAs.
- ``--cert PATH`` / ``--key PATH``: a client certificate, for a listener with
  ``tls_client_ca``.

docs/security.md is the user's page. ``eventplane`` imports this module to
build its parser: ``ssl`` and ``urllib`` are imported when a command uses them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon.errors import DaemonError

if TYPE_CHECKING:
    import ssl
    import urllib.request
    from http.client import HTTPResponse

ENV_ADMIN_TOKEN_FILE = "EVENTPLANE_ADMIN_TOKEN_FILE"
ENV_TOKEN_FILE = "EVENTPLANE_TOKEN_FILE"


class AccessError(DaemonError):
    """A token file or a TLS file given to a command cannot be used (usage: exit 2)."""


@dataclass(frozen=True)
class Access:
    token: str | None = None
    context: ssl.SSLContext | None = None

    def urlopen(self, request: urllib.request.Request, timeout: float) -> HTTPResponse:
        """``urllib.request.urlopen`` with the token and the TLS context."""
        import urllib.request

        if self.token is not None:
            request.add_header("Authorization", f"Bearer {self.token}")
        response: HTTPResponse = urllib.request.urlopen(
            request, timeout=timeout, context=self.context
        )
        return response


NO_ACCESS = Access()


def add_arguments(p: argparse.ArgumentParser, env: str, listener: str) -> None:
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file holding the {listener} token (default: ${env}, if set)",
    )
    p.add_argument(
        "--ca-file",
        metavar="PATH",
        help=f"CA certificate (PEM) that signed the {listener} listener's certificate",
    )
    p.add_argument("--cert", metavar="PATH", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--key", metavar="PATH", help="the client certificate's key (PEM)")


def from_args(args: argparse.Namespace, env: str, environ: Any = None) -> Access:
    """The token and TLS context the arguments ask for; AccessError says which is wrong."""
    import ssl

    from daemon.security import client_context, read_token_file

    environ = os.environ if environ is None else environ
    token_file = getattr(args, "token_file", None) or environ.get(env) or None
    ca_file = getattr(args, "ca_file", None)
    cert = getattr(args, "cert", None)
    key = getattr(args, "key", None)
    token = None
    if token_file:
        source = "--token-file" if getattr(args, "token_file", None) else f"${env}"
        try:
            token = read_token_file(token_file)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise AccessError(f"{source} {token_file}: cannot read the token ({reason})") from exc
    if key and not cert:
        raise AccessError("--key needs --cert (the client certificate it belongs to)")
    context = None
    if ca_file or cert:
        try:
            context = client_context(ca_file, cert, key)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(
                f"{flag} {path}"
                for flag, path in (("--ca-file", ca_file), ("--cert", cert), ("--key", key))
                if path
            )
            raise AccessError(f"cannot use {files}: {exc}") from exc
    return Access(token, context)
