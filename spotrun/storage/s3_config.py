"""Options of the S3 backend and boto3 client construction.

Endpoint, credentials and profile are resolved by boto3 itself from the standard AWS
settings; see :mod:`spotrun.storage.s3`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ProfileNotFound

from spotrun.errors import ConfigError
from spotrun.tools import private_random

MIB = 1024 * 1024
#: S3's smallest allowed multipart part (all parts but the last).
MIN_PART_SIZE_BYTES = 5 * MIB
DEFAULT_REGION = "us-east-1"

# botocore jitters the refresh of instance-role credentials with the global random generator: the
# training's, which a resume restores (spotrun.tools.private_random).
private_random.isolate("botocore.utils")


@dataclass(frozen=True)
class S3Options:
    """Options of :class:`~spotrun.storage.s3.S3Storage`; each may be passed to
    ``open_storage(uri, ...)`` as a keyword argument.

    Attributes:
        endpoint_url: S3 endpoint (``http://127.0.0.1:9000``); ``None`` lets boto3 use
            ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` or AWS itself.
        region_name: region; ``None`` means ``AWS_REGION``, else ``AWS_DEFAULT_REGION`` or
            the profile's region, else ``us-east-1``.
        profile_name: AWS profile; ``None`` means ``AWS_PROFILE`` or the default chain.
        multipart_threshold_bytes: objects of at least this size are uploaded in parts.
        part_size_bytes: bytes per multipart part and per ranged GET; >= 5 MiB.
        max_concurrency: parts transferred at the same time by one call.
        retry_deadline_s: most seconds one operation spends retrying.
        connect_timeout_s: TCP/TLS connect timeout of one request, seconds.
        read_timeout_s: socket read timeout of one request, seconds.
        sleep: waits between retries (tests inject a fake so they never wait).
        clock: monotonic clock for deadlines, seconds (tests inject a fake).

    Raises:
        ConfigError: an out-of-range value.
    """

    endpoint_url: str | None = None
    region_name: str | None = None
    profile_name: str | None = None
    multipart_threshold_bytes: int = 64 * MIB
    part_size_bytes: int = 16 * MIB
    max_concurrency: int = 8
    retry_deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        if self.part_size_bytes < MIN_PART_SIZE_BYTES:
            raise ConfigError(
                f"part_size_bytes must be >= {MIN_PART_SIZE_BYTES} (S3 minimum), got {self.part_size_bytes}"
            )
        if self.multipart_threshold_bytes < 1:
            raise ConfigError(f"multipart_threshold_bytes must be positive, got {self.multipart_threshold_bytes}")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, **options: Any) -> S3Options:
        """Build options from keyword arguments; an unknown name is a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown S3 storage option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


def make_client(options: S3Options) -> Any:
    """A boto3 S3 client with botocore's retries off and the timeouts of ``options``.

    Raises:
        ConfigError: the named profile does not exist, or the endpoint URL is malformed.
    """
    try:
        session = boto3.session.Session(profile_name=options.profile_name)
    except ProfileNotFound as exc:
        raise ConfigError(f"AWS profile not found: {exc}") from exc
    region = (
        options.region_name
        or os.environ.get("AWS_REGION")
        or session.region_name  # AWS_DEFAULT_REGION or the profile's region
        or DEFAULT_REGION
    )
    config = Config(
        # total_max_attempts counts the first request: 1 means botocore never retries
        # (its older "max_attempts" counts retries, so 1 there would mean one retry).
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        max_pool_connections=max(10, options.max_concurrency),
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        return session.client("s3", region_name=region, endpoint_url=options.endpoint_url, config=config)
    except ValueError as exc:
        raise ConfigError(f"bad S3 endpoint URL {options.endpoint_url!r}: {exc}") from exc
