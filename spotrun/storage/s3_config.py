"""Options of the S3 backend and boto3 client construction.

Endpoint, credentials and profile are resolved by boto3 itself from the standard AWS
settings; see :mod:`spotrun.storage.s3`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import boto3
from botocore.config import Config
from botocore.exceptions import ProfileNotFound

from spotrun.errors import ConfigError
from spotrun.storage.options import ObjectStoreOptions
from spotrun.storage.part_sizes import S3_LIMITS
from spotrun.tools import private_random

MIB = 1024 * 1024
#: S3's smallest allowed multipart part (all parts but the last).
MIN_PART_SIZE_BYTES = S3_LIMITS.min_part_bytes
DEFAULT_REGION = "us-east-1"

# botocore jitters the refresh of instance-role credentials with the global random generator: the
# training's, which a resume restores (spotrun.tools.private_random).
private_random.isolate("botocore.utils")


@dataclass(frozen=True)
class S3Options(ObjectStoreOptions):
    """Options of :class:`~spotrun.storage.s3.S3Storage`: those of
    :class:`~spotrun.storage.options.ObjectStoreOptions` (``part_size_bytes`` at least S3's
    5 MiB, ``max_part_size_bytes`` at most its 5 GiB), and

    Attributes:
        endpoint_url: S3 endpoint (``http://127.0.0.1:9000``); ``None`` lets boto3 use
            ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` or AWS itself.
        region_name: region; ``None`` means ``AWS_REGION``, else ``AWS_DEFAULT_REGION`` or
            the profile's region, else ``us-east-1``.
        profile_name: AWS profile; ``None`` means ``AWS_PROFILE`` or the default chain.
    """

    store: ClassVar[str] = "S3"

    endpoint_url: str | None = None
    region_name: str | None = None
    profile_name: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.part_size_bytes < MIN_PART_SIZE_BYTES:
            raise ConfigError(
                f"part_size_bytes must be >= {MIN_PART_SIZE_BYTES} (S3 minimum), got {self.part_size_bytes}"
            )
        if max(self.max_part_size_bytes, self.part_size_bytes) > S3_LIMITS.max_part_bytes:
            raise ConfigError(
                f"part_size_bytes and max_part_size_bytes must be <= {S3_LIMITS.max_part_bytes} (S3 maximum), got "
                f"{self.part_size_bytes} and {self.max_part_size_bytes}"
            )


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
