"""What a Delta stream on S3 needs of the server and the clients, shown on the
real server the S3 tests use (SeaweedFS on loopback):

- credentials are checked (a wrong secret and an unknown key are refused);
- conditional create (``If-None-Match: *``) refuses an object that exists,
  and a conditional overwrite (``If-Match: <ETag>``) refuses a stale ETag:
  what a writer's lease next to the table takes and renews;
- multipart upload (files above one part);
- a self-checked client (the WAL archive's) sends its payload unsigned and
  no checksum of botocore's own, and the server stores the body whole;
- delta-rs commits with conditional puts (``conditional_put = "etag"``): a
  log entry another writer created first is never overwritten, the commit
  lands at the next version instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest

from tests.s3.server import S3Server

pytestmark = pytest.mark.timeout(180)


def _error(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", {})
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def _put_headers(s3: Any) -> list[dict[str, str]]:
    """Each PutObject's headers as ``s3`` sends them (lower-cased names, text
    values), appended as it sends them."""
    sent: list[dict[str, str]] = []

    def record(request: Any, **_: Any) -> None:
        sent.append(
            {
                k.lower(): v.decode() if isinstance(v, bytes) else v
                for k, v in request.headers.items()
            }
        )

    s3.meta.events.register("before-send.s3.PutObject", record)
    return sent


def test_the_server_refuses_wrong_credentials(s3_server: S3Server) -> None:
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as wrong:
        s3_server.client(secret_key="not-the-secret").list_objects_v2(Bucket=s3_server.bucket)
    assert _error(wrong.value)[0] == "SignatureDoesNotMatch"
    with pytest.raises(ClientError) as unknown:
        replace(s3_server, access_key="nobody").client().list_objects_v2(Bucket=s3_server.bucket)
    assert _error(unknown.value)[0] == "InvalidAccessKeyId"


def test_conditional_create_and_overwrite_refuse_a_lost_race(s3_server: S3Server) -> None:
    from botocore.exceptions import ClientError

    s3, bucket = s3_server.client(), s3_server.bucket
    first = s3.put_object(Bucket=bucket, Key="probe/lease", Body=b"a", IfNoneMatch="*")
    with pytest.raises(ClientError) as taken:
        s3.put_object(Bucket=bucket, Key="probe/lease", Body=b"b", IfNoneMatch="*")
    assert _error(taken.value) == ("PreconditionFailed", 412)

    renewed = s3.put_object(Bucket=bucket, Key="probe/lease", Body=b"c", IfMatch=first["ETag"])
    with pytest.raises(ClientError) as stale:
        s3.put_object(Bucket=bucket, Key="probe/lease", Body=b"d", IfMatch=first["ETag"])
    assert _error(stale.value) == ("PreconditionFailed", 412)
    body = s3.get_object(Bucket=bucket, Key="probe/lease")
    assert body["Body"].read() == b"c" and body["ETag"] == renewed["ETag"]


def test_a_self_checked_client_puts_an_unsigned_payload_the_server_stores_whole(
    s3_server: S3Server,
) -> None:
    from daemon.table.s3 import client

    s3 = client(s3_server.config(), self_checked=True)
    sent = _put_headers(s3)
    body = bytes(range(256)) * 4096  # 1 MiB
    s3.put_object(Bucket=s3_server.bucket, Key="probe/unsigned", Body=body, IfNoneMatch="*")

    [headers] = sent
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert not [h for h in headers if h.startswith("x-amz-checksum-")]
    got = s3_server.client().get_object(Bucket=s3_server.bucket, Key="probe/unsigned")
    assert got["Body"].read() == body

    plain = client(s3_server.config())
    signed = _put_headers(plain)
    plain.put_object(Bucket=s3_server.bucket, Key="probe/signed", Body=b"x")
    assert signed[0]["x-amz-content-sha256"] != "UNSIGNED-PAYLOAD"


def test_multipart_upload_assembles_the_parts(s3_server: S3Server) -> None:
    s3, bucket, key = s3_server.client(), s3_server.bucket, "probe/multipart"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for n in (1, 2):
        body = bytes([n]) * (5 * 1024 * 1024)  # 5 MiB: S3's smallest part but the last
        etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=body)
        parts.append({"PartNumber": n, "ETag": etag["ETag"]})
    s3.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    got = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(got) == 10 * 1024 * 1024 and got[0] == 1 and got[-1] == 2


def test_delta_rs_never_overwrites_a_log_entry_another_writer_created(
    s3_server: S3Server,
) -> None:
    import deltalake

    uri = f"s3://{s3_server.bucket}/probe/table"
    options = s3_server.storage_options()
    rows = pa.table({"lsn": pa.array([1, 2, 3], pa.int64())})
    deltalake.write_deltalake(uri, rows, mode="append", storage_options=options)
    version = deltalake.DeltaTable(uri, storage_options=options).version()

    # Another writer takes the next version first.
    rival = f"probe/table/_delta_log/{version + 1:020d}.json"
    entry = b'{"commitInfo":{"operation":"RIVAL","timestamp":0}}\n'
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=rival, Body=entry)
    deltalake.write_deltalake(uri, rows, mode="append", storage_options=options)

    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key=rival)["Body"].read()
    assert body == entry  # not overwritten
    assert deltalake.DeltaTable(uri, storage_options=options).version() == version + 2
