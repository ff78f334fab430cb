"""Every notice source by its ``--notice`` name, and the parsed ``--notice`` value.

A new source is one module (a :class:`~spotrun.notices.base.NoticeSource` and a ``build``
function) and one line in :data:`SOURCES`. Which sources run is decided in
:mod:`spotrun.notices.detect` from these registrations alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from spotrun.errors import ConfigError
from spotrun.notices import aws, azure, files, gcp, signals
from spotrun.notices.base import Endpoint, NoticeSource

if TYPE_CHECKING:
    from spotrun.notices.options import NoticeOptions


@dataclass(frozen=True)
class Registration:
    """How to build one kind of source, and when ``--notice auto`` runs it.

    Attributes:
        build: ``(options, environ) -> sources`` (GCP watches two values, so a list);
            raises ``ConfigError`` for a bad setting.
        always: run whatever ``--notice`` says (signals: no signal may end the supervisor).
        in_auto: ``options -> bool``: whether ``auto`` runs it without detection (the file
            source when a notice file is set); ``None``: only a detected cloud or a named source.
        endpoint: a cloud's ``(options, environ) -> Endpoint``: where its metadata server is
            and which setting named it; ``auto`` probes a cloud that DMI
            (:mod:`spotrun.notices.dmi`) or a setting names.
        probe: a cloud's ``(url, timeout_s) -> bool``: whether the server answers like it.
    """

    build: Callable[[NoticeOptions, Mapping[str, str]], list[NoticeSource]]
    always: bool = False
    in_auto: Callable[[NoticeOptions], bool] | None = None
    endpoint: Callable[[NoticeOptions, Mapping[str, str]], Endpoint] | None = None
    probe: Callable[[str, float], bool] | None = None


#: The sources by name, in the order they are listed, probed and started.
SOURCES: Mapping[str, Registration] = MappingProxyType(
    {
        "aws": Registration(aws.build, endpoint=aws.endpoint, probe=aws.probe),
        "gcp": Registration(gcp.build, endpoint=gcp.endpoint, probe=gcp.probe),
        "azure": Registration(azure.build, endpoint=azure.endpoint, probe=azure.probe),
        "signal": Registration(signals.build, always=True),
        "file": Registration(files.build, in_auto=files.configured),
    }
)
SOURCE_NAMES = tuple(SOURCES)
#: The sources ``auto`` can detect.
CLOUDS = tuple(name for name, registration in SOURCES.items() if registration.probe is not None)


@dataclass(frozen=True)
class NoticeChoice:
    """A parsed ``--notice`` value.

    Attributes:
        auto: detect the cloud when the sources are built.
        names: the sources named explicitly (empty for ``auto`` and ``none``).
    """

    auto: bool
    names: frozenset[str]


def parse_notice_option(value: str) -> NoticeChoice:
    """Parse ``auto``, ``none`` or a comma-separated list such as ``aws,signal``.

    Raises:
        ConfigError: an empty value, an unknown name, or auto/none mixed with names.
    """
    parts = [p.strip().lower() for p in str(value).split(",")]
    if parts == ["auto"]:
        return NoticeChoice(auto=True, names=frozenset())
    if parts == ["none"]:
        return NoticeChoice(auto=False, names=frozenset())
    unknown = [p for p in parts if p not in SOURCES]
    if not value.strip() or unknown:
        raise ConfigError(
            f"--notice: expected auto, none or a comma-separated list of {', '.join(SOURCE_NAMES)}; got {value!r}"
        )
    return NoticeChoice(auto=False, names=frozenset(parts))
