"""Which cloud this machine runs on, from local DMI (SMBIOS) facts: no network at all.

Linux exposes the firmware's SMBIOS strings under ``/sys/class/dmi/id``. Like cloud-init's
``ds-identify`` and Google's auth library, spotrun decides "am I on cloud X?" from these files
first, so that ``--notice auto`` never resolves or connects to a metadata address on a laptop
or a CI runner. The facts per cloud, with their sources, are in ``docs/design/internals.md``
(Notices); :data:`DMI_ROOT_ENV` points spotrun at another directory (tests, containers).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_DMI_ROOT = "/sys/class/dmi/id"
#: Environment variable naming another DMI directory (tests, containers).
DMI_ROOT_ENV = "SPOTRUN_DMI_ROOT"
#: Azure's chassis asset tag (ASCII codes of "MSFT AZURE VM").
AZURE_CHASSIS_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
#: The DMI files read, in the order they are reported.
FIELDS = (
    "sys_vendor",
    "product_name",
    "product_version",
    "board_vendor",
    "bios_vendor",
    "bios_version",
    "chassis_asset_tag",
    "product_serial",
    "product_uuid",
)
_MAX_FIELD_BYTES = 256  # SMBIOS strings are short; never read more than this from a file


@dataclass(frozen=True)
class DmiFacts:
    """The DMI strings that could be read from one directory.

    Attributes:
        root: the directory read.
        values: field name -> its stripped text, for each file that exists and is readable
            (an empty mapping when DMI is hidden, e.g. in some containers).
    """

    root: str
    values: Mapping[str, str]

    @property
    def available(self) -> bool:
        """Whether any DMI file could be read."""
        return bool(self.values)

    def get(self, field: str) -> str:
        """The field's text, ``""`` when missing or unreadable."""
        return self.values.get(field, "")

    def describe(self) -> str:
        """A short summary for logs, e.g. ``sys_vendor='Dell Inc.', product_name='XPS 13'``."""
        shown = [f"{name}={self.values[name]!r}" for name in FIELDS[:3] if self.values.get(name)]
        return ", ".join(shown) or "no identifying fields"


def dmi_root(environ: Mapping[str, str] | None = None) -> str:
    """``$SPOTRUN_DMI_ROOT`` if set and not empty, else ``/sys/class/dmi/id``."""
    env = os.environ if environ is None else environ
    return env.get(DMI_ROOT_ENV) or DEFAULT_DMI_ROOT


def read_dmi(root: str) -> DmiFacts:
    """Read the :data:`FIELDS` files under ``root``; missing or unreadable ones are left out.

    Never raises for a missing directory or file (that is "DMI hidden"), and opens no socket.
    """
    values: dict[str, str] = {}
    for name in FIELDS:
        try:
            with open(os.path.join(root, name), "rb") as f:
                raw = f.read(_MAX_FIELD_BYTES)
        except OSError:  # absent, not readable by this user (product_uuid), or no DMI at all
            continue
        values[name] = raw.decode("utf-8", errors="replace").strip()
    return DmiFacts(root=root, values=values)


def _is_aws(facts: DmiFacts) -> bool:
    vendors = {facts.get(f).lower() for f in ("sys_vendor", "board_vendor", "bios_vendor")}
    if "amazon ec2" in vendors:
        return True
    if any("amazon" in facts.get(f).lower() for f in ("product_version", "bios_version")):
        return True
    uuid, serial = facts.get("product_uuid").lower(), facts.get("product_serial").lower()
    return uuid.startswith("ec2") and uuid == serial


def _is_gcp(facts: DmiFacts) -> bool:
    if facts.get("product_name").startswith("Google"):
        return True
    if "Google" in {facts.get(f) for f in ("sys_vendor", "board_vendor", "bios_vendor")}:
        return True
    return facts.get("product_serial").startswith("GoogleCloud-")


def _is_azure(facts: DmiFacts) -> bool:
    return facts.get("chassis_asset_tag") == AZURE_CHASSIS_ASSET_TAG


_CHECKS = (("aws", _is_aws), ("gcp", _is_gcp), ("azure", _is_azure))


def cloud_from_dmi(facts: DmiFacts) -> str | None:
    """``"aws"``, ``"gcp"`` or ``"azure"`` when ``facts`` name that cloud (see the module
    docstring for the rules and their sources), else ``None``. Pure: no I/O."""
    for cloud, check in _CHECKS:
        if check(facts):
            return cloud
    return None
