"""A Delta stream's table on S3-compatible storage: where it is, how to reach it.

A stream whose ``path`` is ``s3://bucket/prefix`` (or ``s3a://``) keeps its
table (``_delta_log/``, the partition folders and the writer's lease
``_eventplane/lease.json``) under that prefix, and its own state (ledger,
lock, quarantine, staging) on the daemon's disk under
``<data_dir>/tables/<stream>/``. The ``[s3]`` section says how to reach the
store (docs/cdc.md, "Tables on S3").

Credentials come from, in order: ``[s3] access_key_id`` and
``secret_access_key``; the AWS shared-credentials file ``[s3]
credentials_file`` names (its ``profile``); the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``).
With none of them, boto3 and delta-rs look where they always look. Secrets
are never logged, and :class:`~daemon.config.S3Config` hides them from its
``repr``.
"""

from __future__ import annotations

import configparser
import os
import uuid
from dataclasses import dataclass
from typing import Any

from daemon.config import S3Config
from daemon.errors import DaemonError


class S3Error(DaemonError):
    """The store cannot be reached or used as configured."""


@dataclass(frozen=True, slots=True)
class Location:
    """``s3://bucket/prefix``: the bucket and the key prefix (no slashes at its ends)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> Location:
        rest = uri.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        return cls(bucket, prefix.strip("/"))

    @property
    def uri(self) -> str:
        """The table's URI for delta-rs (``s3://``, which it reads for ``s3a://`` too)."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, rel: str) -> str:
        """The object key of the table's file ``rel``."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def rel(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str = ""
    source: str = ""  # where they came from, for messages (never the values)


def credentials(cfg: S3Config) -> Credentials | None:
    """The credentials the config names (module doc for the order), or None."""
    if cfg.access_key_id:
        return Credentials(cfg.access_key_id, cfg.secret_access_key, "", "[s3] access_key_id")
    if cfg.credentials_file is not None:
        return _from_file(cfg)
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        token = os.environ.get("AWS_SESSION_TOKEN", "")
        return Credentials(key, secret, token, "the environment (AWS_ACCESS_KEY_ID)")
    return None


def _from_file(cfg: S3Config) -> Credentials:
    path = cfg.credentials_file
    assert path is not None
    parser = configparser.ConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except OSError as exc:
        raise S3Error(f"s3.credentials_file: cannot read {path} ({exc.strerror})") from exc
    except configparser.Error as exc:
        raise S3Error(
            f"s3.credentials_file: {path} is not an AWS credentials file "
            f"([profile] with aws_access_key_id and aws_secret_access_key): {exc.message}"
        ) from exc
    if not parser.has_section(cfg.profile):
        raise S3Error(f"s3.credentials_file: {path} has no [{cfg.profile}] profile")
    section = parser[cfg.profile]
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if not section.get(k)]
    if missing:
        raise S3Error(f"s3.credentials_file: [{cfg.profile}] of {path} has no {missing[0]}")
    return Credentials(
        section["aws_access_key_id"],
        section["aws_secret_access_key"],
        section.get("aws_session_token", ""),
        f"{path} [{cfg.profile}]",
    )


def client(cfg: S3Config, *, self_checked: bool = False) -> Any:
    """A boto3 S3 client for the store (timeouts and retries from ``[s3]``).

    ``self_checked``: the objects carry their own checksums, checked by every
    reader (the WAL archive's, wal/archive.py), so botocore computes and checks
    none of its own unless the operation requires one (about a sixth of a
    PUT's client CPU), and signs no payload: the request is sent as
    UNSIGNED-PAYLOAD, which botocore does over https anyway and otherwise
    hashes every byte (a 3.5 MB PUT: 5.2 ms of client CPU signed, 2.7 ms
    unsigned: bench/RESULTS.md, bench_archive). Over plain http a payload
    changed in transit then passes the store's signature check; the object's
    CRC32C still fails its reader.

    These bound every request of a commit, here and in ``storage_options``:
    at most (max_retries + 1) x (connect_timeout_s + request_timeout_s)
    plus backoff. The cross-check of daemon/config.py (issue 40) requires
    that to fit the lease window (lease_ttl_s - lease_skew_s), so no request
    outlives the lease it was made under; the stage's own thread (a stream's
    commit, a mirror's merge: its lane, daemon/spark/lanes.py) then ends with
    an error and the stage retries.
    """
    import boto3
    from botocore.config import Config

    creds = credentials(cfg)
    keys: dict[str, str] = {}
    if creds is not None:
        keys = {
            "aws_access_key_id": creds.access_key_id,
            "aws_secret_access_key": creds.secret_access_key,
        }
        if creds.session_token:
            keys["aws_session_token"] = creds.session_token
    s3: dict[str, Any] = {"addressing_style": "path" if cfg.path_style else "auto"}
    checks: dict[str, str] = {}
    if self_checked:
        s3["payload_signing_enabled"] = False
        checks = {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
    return boto3.client(
        "s3",
        endpoint_url=cfg.endpoint or None,
        region_name=cfg.region,
        config=Config(
            s3=s3,
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.request_timeout_s,
            retries={"max_attempts": cfg.max_retries + 1, "mode": "standard"},
            **checks,
        ),
        **keys,
    )


def storage_options(cfg: S3Config) -> dict[str, str]:
    """delta-rs's options for the store: conditional puts by ETag (a log entry
    another writer created is never overwritten), the same timeouts."""
    opts = {
        "AWS_REGION": cfg.region,
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false" if cfg.path_style else "true",
        "conditional_put": "etag",
        "timeout": f"{cfg.request_timeout_s:g}s",
        "connect_timeout": f"{cfg.connect_timeout_s:g}s",
        "max_retries": str(cfg.max_retries),
    }
    if cfg.endpoint:
        opts["AWS_ENDPOINT_URL"] = cfg.endpoint
        if cfg.endpoint.startswith("http://"):
            opts["AWS_ALLOW_HTTP"] = "true"
    creds = credentials(cfg)
    if creds is not None:
        opts["AWS_ACCESS_KEY_ID"] = creds.access_key_id
        opts["AWS_SECRET_ACCESS_KEY"] = creds.secret_access_key
        if creds.session_token:
            opts["AWS_SESSION_TOKEN"] = creds.session_token
    return opts


def explain(exc: BaseException, cfg: S3Config, where: Location) -> str:
    """One line saying what is wrong with reaching ``where`` (no bucket, no
    permission, wrong credentials, wrong endpoint)."""
    endpoint = cfg.endpoint or f"AWS S3 ({cfg.region})"
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket", "404") or status == 404:
            return f"bucket {where.bucket!r} does not exist at {endpoint}"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"):
            creds = credentials(cfg)
            source = creds.source if creds else "the default AWS chain"
            return f"{endpoint} refused the credentials from {source} ({code})"
        if code in ("AccessDenied", "403", "AllAccessDisabled") or status == 403:
            return f"no permission on bucket {where.bucket!r} at {endpoint} ({code or status})"
        return f"{endpoint} answered {code or status}: {exc}"
    name = type(exc).__name__
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return f"cannot reach {endpoint} ({name}): check [s3] endpoint and the network"
    if name == "NoCredentialsError":
        return (
            "no S3 credentials: set [s3] credentials_file, or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the environment"
        )
    return f"{endpoint}: {name}: {exc}"


def refuses_second_create(s3: Any, where: Location) -> str | None:
    """The store refuses a conditional create of an object that exists
    (``If-None-Match: *``), which the writer's lease needs; else why not.
    Three requests: a PUT that creates, one that must be refused, a DELETE."""
    from botocore.exceptions import ClientError

    key = where.key(f"_eventplane/probe-{uuid.uuid4().hex}")
    try:
        s3.put_object(Bucket=where.bucket, Key=key, Body=b"1", IfNoneMatch="*")
    except ClientError as exc:
        # A fresh key refused: the client retried a create whose answer was
        # lost, and the store refused the retry, as it should.
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (409, 412):
            raise
        s3.delete_object(Bucket=where.bucket, Key=key)
        return None
    try:
        s3.put_object(Bucket=where.bucket, Key=key, Body=b"2", IfNoneMatch="*")
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (409, 412):
            return None
        return f"a conditional create answered {status}, not 412 Precondition Failed"
    finally:
        s3.delete_object(Bucket=where.bucket, Key=key)
    return (
        "the store overwrote an object despite If-None-Match: * (no conditional writes): "
        "a table on it cannot be fenced to one writer"
    )


def check(cfg: S3Config, uri: str) -> str | None:
    """What is wrong with the table's place at ``uri``, in one line, or None:
    the bucket reached (a LIST under the prefix), a conditional create refused
    the second time. ``check-config`` prints it; a stream's open raises it."""
    where = Location.parse(uri)
    try:
        s3 = client(cfg)
        s3.list_objects_v2(Bucket=where.bucket, Prefix=where.key(""), MaxKeys=1)
        return refuses_second_create(s3, where)
    except S3Error as exc:
        return str(exc)
    except Exception as exc:
        return explain(exc, cfg, where)
