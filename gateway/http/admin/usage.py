"""The usage export (``GET /admin/usage``): usage per day, grouped, as JSON or CSV."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from aiohttp import web

from gateway.core.errors import BadRequest
from gateway.http.admin.access import admin_services
from gateway.scheduling.usage import DIMENSIONS, group, to_csv


def _day(request: web.Request, name: str, default: date) -> date:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be a date, YYYY-MM-DD", param=name) from None


async def get_usage(request: web.Request) -> web.StreamResponse:
    """Usage per UTC day summed along ``group_by`` (``day,tenant,user,key,model,class``;
    default ``tenant,user``) over ``from``..``to`` (dates, inclusive; default today), as
    JSON or, with ``format=csv``, as CSV."""
    svc = await admin_services(request)
    by = [d.strip() for d in request.query.get("group_by", "tenant,user").split(",")
          if d.strip()]
    if not by or any(d not in DIMENSIONS for d in by) or len(set(by)) != len(by):
        raise BadRequest(f"'group_by' must name distinct dimensions of {', '.join(DIMENSIONS)}",
                         param="group_by")
    today = datetime.now(UTC).date()
    first, last = _day(request, "from", today), _day(request, "to", today)
    if first > last:
        raise BadRequest("'from' is after 'to'", param="from")
    oldest = today - timedelta(days=svc.usage.retention_days)
    first, last = max(first, oldest), min(last, today)
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "csv"):
        raise BadRequest("'format' must be json or csv", param="format")
    rows = group(await svc.usage.rows(first, last), by) if first <= last else []
    if fmt == "csv":
        return web.Response(text=to_csv(rows, by), content_type="text/csv", headers={
            "Content-Disposition": f'attachment; filename="fairgate-usage-{first}-{last}.csv"'})
    return web.json_response({"object": "list", "from": first.isoformat(),
                              "to": last.isoformat(), "group_by": by, "data": rows})
