"""The explorer's routers: `api` (JSON under /api) and `page` (the static page)."""
