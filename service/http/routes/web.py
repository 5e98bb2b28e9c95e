"""The page at / to try the model (service/web/: one HTML file, one script, one stylesheet, sample images) and the
API docs at /docs, Swagger UI with its files from the fastapi-offline package: nothing the browser loads comes
from another host, and each page's Content-Security-Policy says so to the browser too. There is no /redoc: ReDoc
(also in that package) draws a logo from its maker's server, whatever its options say.

Plain routes, included after the API's and with no middleware of their own: the routing of /v1 and /v2 requests
never reaches them. Files are read once, on first use, from an allow-list made when the module loads.
"""
from __future__ import annotations

import hashlib
from functools import cache
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.exceptions import HTTPException

router = APIRouter(include_in_schema=False)

WEB_DIR = Path(__file__).resolve().parents[2] / "web"  # service/web
DOCS_ASSETS_DIR = Path(str(files("fastapi_offline") / "static"))
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
               ".json": "application/json", "": "text/plain; charset=utf-8"}
# The page runs only its own script and style; images may also be the visitor's own (blob:) files.
PAGE_POLICY = ("default-src 'self'; img-src 'self' blob:; object-src 'none'; base-uri 'none'; "
               "form-action 'none'; frame-ancestors 'none'")
# Swagger UI's page starts it with an inline script: still nothing from another host.
DOCS_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
               "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def web_files() -> dict[str, Path]:
    """Every file under service/web/ by its path relative to it: the only names /web/ serves."""
    return {p.relative_to(WEB_DIR).as_posix(): p for p in sorted(WEB_DIR.rglob("*"))
            if p.is_file() and p.suffix in MEDIA_TYPES and p.name != "index.html"}


WEB_FILES = web_files()


@cache
def _read(path: Path) -> tuple[bytes, str]:
    """A file's bytes and their entity tag."""
    body = path.read_bytes()
    return body, f'"{hashlib.sha256(body).hexdigest()[:20]}"'


def _file_response(request: Request, path: Path, policy: str | None = None) -> Response:
    """The file, or 304 when the browser's copy is current (`no-cache`: it asks each time, and gets 304)."""
    body, etag = _read(path)
    headers = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if policy:
        headers["Content-Security-Policy"] = policy
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=MEDIA_TYPES.get(path.suffix, MEDIA_TYPES[""]), headers=headers)


@router.get("/")
async def page(request: Request) -> Response:
    return _file_response(request, WEB_DIR / "index.html", PAGE_POLICY)


@router.get("/web/{name:path}")
async def web_file(request: Request, name: str) -> Response:
    if name not in WEB_FILES:
        raise HTTPException(404, f"no file {name[:100]!r} under /web/")  # answered as not_found
    return _file_response(request, WEB_FILES[name])


@router.get("/docs/assets/{name}")
async def docs_asset(request: Request, name: str) -> Response:
    if name not in DOCS_ASSETS:
        raise HTTPException(404, f"no file {name[:100]!r} under /docs/assets/")
    return _file_response(request, DOCS_ASSETS_DIR / name)


@router.get("/docs")
async def swagger_ui(request: Request) -> Response:
    root, app = request.scope.get("root_path", ""), request.app
    page = get_swagger_ui_html(openapi_url=root + app.openapi_url, title=f"{app.title} API",
                               swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
                               swagger_favicon_url=f"{root}/web/favicon.svg",
                               swagger_ui_parameters={"validatorUrl": None})  # no badge from validator.swagger.io
    page.headers["Content-Security-Policy"] = DOCS_POLICY
    return page

