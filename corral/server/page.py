"""The page for people at /ui: plain files from the wheel, answered under a strict policy.

Nothing is built and nothing comes from the network: the browser gets these files
and talks to the same daemon's API. The Content-Security-Policy lets the page run
only its own scripts and styles and reach only this origin, so a model's output
can never load or run anything even if it reached the DOM as markup (it does not:
the page only ever sets text). The files are public (no API key is asked for
them); the API calls they make are guarded like any other client's.
"""

from __future__ import annotations

from pathlib import Path

from corral.errors import NotFound
from corral.server.http import Handler, Request, Route

UI_DIR = Path(__file__).with_name("ui")
PREFIX = "/ui/"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
          "media-src data: blob:; "
          "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = [("content-security-policy", POLICY), ("x-content-type-options", "nosniff"),
           ("referrer-policy", "no-referrer"), ("x-frame-options", "DENY"),
           ("cache-control", "no-cache")]


def is_page(method: str, path: str) -> bool:
    """The page's own files, which need no API key (they hold nothing of the user's)."""
    return method in ("GET", "HEAD") and (path == "/ui" or path.startswith(PREFIX))


def files(root: Path = UI_DIR) -> dict[str, Path]:
    """Every file the page may be served from, by URL name. Read once: a request names a
    key of this table, never a path on disk, so no URL can reach outside the folder."""
    return {p.name: p for p in root.iterdir() if p.suffix in TYPES and p.is_file()}


def page(root: Path = UI_DIR) -> Route:
    table = files(root)

    def route(req: Request, handler: Handler) -> None:
        name = req.path[len(PREFIX):] if req.path.startswith(PREFIX) else ""
        path = table.get(name or "index.html")
        if path is None:
            raise NotFound("404 page not found")
        handler.send_bytes(200, path.read_bytes(), [("content-type", TYPES[path.suffix]),
                                                    *HEADERS])
    return route
