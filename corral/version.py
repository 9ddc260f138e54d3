"""The version, read once from the installed distribution's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def corral_version() -> str:
    try:
        return version("corral")
    except PackageNotFoundError:
        return "0.0.0+unknown"
