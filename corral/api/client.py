"""The HTTP client the CLI uses: JSON bodies as Ollama's API has them, errors as CorralError.

If nothing answers on a loopback CORRAL_HOST, `ensure_daemon` starts the daemon
in the background (api.autostart), logging to the state dir, and waits until it
is healthy.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Generator

import httpx

from corral.api import autostart
from corral.config import Settings
from corral.errors import CorralError, NotFound


class ClientError(CorralError):
    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def _error(resp: httpx.Response) -> ClientError:
    try:
        body = resp.json()
        message = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        message = None
    return ClientError(str(message or resp.text.strip() or f"HTTP {resp.status_code}"),
                       resp.status_code)


class Client:
    def __init__(self, settings: Settings, timeout: float | None = None) -> None:
        self.settings = settings
        self.base = settings.host.base_url()
        headers = {"User-Agent": "corral-cli"}
        if settings.api_key:
            headers["Authorization"] = f"Bearer {settings.api_key}"
        self._headers, self._timeout = headers, timeout
        self.http = self._open()

    def _open(self) -> httpx.Client:
        # The daemon is local; a proxy from the environment must not get in between.
        return httpx.Client(base_url=self.base, headers=self._headers, trust_env=False,
                            timeout=httpx.Timeout(self._timeout or 30.0, read=None))

    def close(self) -> None:
        self.http.close()

    def hang_up(self) -> None:
        """Close every connection, so the daemon sees each stream it was sending end.

        Ctrl-C can land anywhere inside httpx, also where the interrupted stream's
        connection is neither closed nor returned; the daemon would then keep generating
        the abandoned answer, and the next request could wait behind it. A fresh pool
        leaves no such connection behind.
        """
        self.http.close()
        self.http = self._open()

    # ---- the daemon ----------------------------------------------------------------------

    def alive(self) -> bool:
        try:
            return self.http.head("/", timeout=2.0).status_code < 500
        except httpx.HTTPError:
            return False

    def ensure_daemon(self, wait: float = 30.0, preload: str | None = None) -> Path | None:
        """Start a background daemon when none answers locally; returns its log path.

        `preload` names a model the daemon should start loading at once.
        """
        if self.alive():  # already up, or started early by this very command
            return autostart.log_path() if autostart.spawned() else None
        if not autostart.may_autostart(self.settings):
            raise CorralError(f"could not connect to corral server at {self.base}; "
                              "is CORRAL_HOST right and is 'corral serve' running there?")
        proc = autostart.spawn(preload)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.alive():
                return autostart.log_path()
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        raise CorralError(f"could not start corral server; see {autostart.log_path()}")

    # ---- requests ------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            resp = self.http.request(method, path, json=body)
        except httpx.ConnectError:
            raise CorralError(f"could not connect to corral server at {self.base}, "
                              "run 'corral serve' to start it") from None
        except httpx.HTTPError as exc:
            raise CorralError(f"request to corral server failed: {exc}") from None
        if resp.status_code >= 400:
            raise _error(resp)
        return resp.json() if resp.content else {}

    def stream(self, path: str, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        """NDJSON objects; an `error` line raises."""
        try:
            with self.http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error(resp)
                for line in resp.iter_lines():
                    if not line:
                        continue
                    obj = json.loads(line)
                    if "error" in obj:
                        raise ClientError(str(obj["error"]))
                    yield obj
        except httpx.ConnectError:
            raise CorralError(f"could not connect to corral server at {self.base}, "
                              "run 'corral serve' to start it") from None
        except httpx.HTTPError as exc:
            raise CorralError(f"lost the connection to corral server: {exc}") from None

    def tags(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/tags")["models"])

    def ps(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/ps")["models"])

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model}
        if verbose:
            body["verbose"] = True
        return dict(self._call("POST", "/api/show", body))

    def exists(self, model: str) -> bool:
        try:
            self.show(model)
        except ClientError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def copy(self, src: str, dst: str) -> None:
        self._call("POST", "/api/copy", {"source": src, "destination": dst})

    def delete(self, model: str) -> None:
        self._call("DELETE", "/api/delete", {"model": model})

    def load(self, model: str) -> None:
        """Load `model`: an empty generate, as Ollama's clients preload one."""
        self._call("POST", "/api/generate", {"model": model})

    def stop(self, model: str) -> None:
        try:
            self._call("POST", "/api/generate", {"model": model, "keep_alive": 0})
        except ClientError as exc:
            if exc.status == 404:
                raise NotFound(f'couldn\'t find model "{model}" to stop') from None
            raise

    def create_blob(self, path: Path, digest: str) -> None:
        try:
            if self.http.head(f"/api/blobs/{digest}").status_code == 200:
                return
            with open(path, "rb") as f:
                resp = self.http.post(f"/api/blobs/{digest}", content=iter(
                    lambda: f.read(1 << 20), b""), headers={
                        "Content-Length": str(os.fstat(f.fileno()).st_size)})
        except httpx.HTTPError as exc:
            raise CorralError(f"uploading {path.name} failed: {exc}") from None
        if resp.status_code >= 400:
            raise _error(resp)
