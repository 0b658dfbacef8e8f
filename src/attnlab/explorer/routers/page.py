"""The page: index.html at /, its script and style under /static, all from the package's static/
folder.

Its Content-Security-Policy (security.CSP, set on every response by security.Guard) allows only this
origin's scripts, styles and images, so the page cannot load anything from the network even by
mistake.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse

from .. import STATIC

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def mount_static(app: FastAPI) -> None:
    from fastapi.staticfiles import StaticFiles

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
