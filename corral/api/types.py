"""Formatting shared by the server and the client (Go's time format); the wire records
themselves are in api.wire."""

from __future__ import annotations

import datetime as _dt


def rfc3339(ts: float, utc: bool = True) -> str:
    """RFC3339 with nanosecond digits, as Go prints times (UTC `Z` for created_at)."""
    if utc:
        moment = _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}000Z"
    moment = _dt.datetime.fromtimestamp(ts).astimezone()
    offset = moment.strftime("%z")
    return (moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}000"
            + f"{offset[:3]}:{offset[3:]}")


def nanoseconds(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


STREAM_CONTENT_TYPE = "application/x-ndjson"
JSON_CONTENT_TYPE = "application/json; charset=utf-8"
