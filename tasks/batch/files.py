"""Batch files' bytes in S3: ``s3://<batch_bucket>/files/<file id>`` (input, output and error
files), and a running batch's chunks under ``batches/<batch id>/chunks/``, each written whole
(one PUT) once its lines are answered, so a resumed runner skips exactly what was written."""

from __future__ import annotations

import json
from collections.abc import Iterator

from botocore.config import Config
from botocore.exceptions import ClientError

from modelops.settings import Settings
from tasks.s3 import s3_client

__all__ = ["BatchFiles"]


class BatchFiles:
    """The batch bucket on the stack's S3 (tasks/s3.py: the settings' endpoint and keys, or the
    ``aws_credentials_block``'s, as model sources use).

    Args:
        settings: ``batch_bucket``, and ``aws_credentials_block`` or ``s3_endpoint`` and the
            ``aws_*`` keys.

    Raises:
        ValueError: ``aws_credentials_block`` names no block (tasks/s3.py).
    """

    def __init__(self, settings: Settings) -> None:
        self.bucket = settings.batch_bucket
        self.client, _ = s3_client(settings, Config(retries={"max_attempts": 5, "mode": "standard"}))
        self._ready = False

    def _bucket(self) -> str:
        if not self._ready:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError:
                try:
                    self.client.create_bucket(Bucket=self.bucket)
                except ClientError as e:  # made meanwhile by another process
                    if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            self._ready = True
        return self.bucket

    def put_file(self, file_id: str, data: bytes) -> None:
        self.client.put_object(Bucket=self._bucket(), Key=f"files/{file_id}", Body=data)

    def read_file(self, file_id: str) -> bytes:
        return self.client.get_object(Bucket=self._bucket(), Key=f"files/{file_id}")["Body"].read()

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines, streamed (without their line ends)."""
        body = self.client.get_object(Bucket=self._bucket(), Key=f"files/{file_id}")["Body"]
        yield from body.iter_lines(keepends=False)

    def delete_file(self, file_id: str) -> None:
        self.client.delete_object(Bucket=self._bucket(), Key=f"files/{file_id}")

    def put_chunk(self, batch_id: str, name: str, records: list[dict]) -> None:
        """Write one chunk's records (``{"line", "kind": "output"|"error", "record"}``) whole."""
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        self.client.put_object(Bucket=self._bucket(), Key=f"batches/{batch_id}/chunks/{name}.jsonl", Body=data)

    def chunks(self, batch_id: str) -> Iterator[dict]:
        """Every record of the batch's written chunks, in chunk order."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket(),
                                                                       Prefix=f"batches/{batch_id}/chunks/")
        for key in sorted(o["Key"] for page in pages for o in page.get("Contents", [])):
            for line in self.client.get_object(Bucket=self.bucket, Key=key)["Body"].iter_lines():
                if line:
                    yield json.loads(line)
