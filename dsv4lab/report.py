"""``dsv4lab report``: executed notebooks to HTML, with an index page.

:func:`build_report` converts every executed notebook in ``executed_dir`` (what
``dsv4lab run`` wrote to build/notebooks/) to ``html_dir/<name>.html`` with nbconvert,
and writes ``html_dir/index.html``: one row per notebook with its status, mode, time
and device from ``summary.json`` (or, for a notebook run some other way, from the
papermill metadata inside it), and a link that resolves. Notebooks listed in the
summary without an executed copy are listed too, without a link.

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
from pathlib import Path

STATUS_COLORS = {"pass": "#1a7f37", "fail": "#cf222e"}


def _load_summary(executed_dir: Path) -> dict[str, dict]:
    path = executed_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-run `dsv4lab run`") from e
    return {r["notebook"]: r for r in rows if isinstance(r, dict) and "notebook" in r}


def _status_from_notebook(nb) -> dict:
    """Status and time from papermill's metadata and the outputs (no summary row)."""
    pm = nb.metadata.get("papermill", {}) or {}
    errored = bool(pm.get("exception")) or any(
        o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    seconds = pm.get("duration")
    mode = (pm.get("parameters") or {}).get("MODE", "")
    return {"status": "fail" if errored else "pass",
            "seconds": round(float(seconds), 1) if seconds is not None else "",
            "mode": mode, "device": "", "error": ""}


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _prefer_static_fallbacks(nb) -> None:
    """Where a widget output also carries a static view (HTML or an image), keep the static
    one: a live widget needs a JavaScript widget manager from the network to draw in a
    static page, the fallback draws anywhere. Widgets without a fallback are left alone."""
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = out.get("data", {})
            if WIDGET_VIEW in data and any(k in data for k in ("text/html", "image/png", "image/svg+xml")):
                del data[WIDGET_VIEW]


def _convert(nb_path: Path, out_path: Path):
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(nb_path, as_version=4)
    _prefer_static_fallbacks(nb)
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": nb_path.stem}})
    out_path.write_text(body, encoding="utf-8")
    return nb


def build_report(executed_dir, html_dir) -> Path:
    """Convert ``executed_dir/*.ipynb`` to ``html_dir/*.html``; return the index's path."""
    executed_dir, html_dir = Path(executed_dir), Path(html_dir)
    if not executed_dir.is_dir():
        raise FileNotFoundError(f"{executed_dir} does not exist: run `dsv4lab run` first")
    html_dir.mkdir(parents=True, exist_ok=True)
    summary = _load_summary(executed_dir)
    entries: dict[str, dict] = {}
    for nb_path in sorted(executed_dir.glob("*.ipynb")):
        name = nb_path.stem
        target = html_dir / f"{name}.html"
        row = dict(summary.get(name, {}))
        try:
            nb = _convert(nb_path, target)
            link = target.name
            if not row:
                row = _status_from_notebook(nb)
        except Exception as e:  # an unreadable notebook is reported, not fatal
            link = None
            row = {**row, "status": row.get("status", "fail"),
                   "error": (row.get("error") or "") + f" (HTML conversion failed: {type(e).__name__}: {e})"}
        entries[name] = {**row, "notebook": name, "link": link}
    for name, row in summary.items():
        if name not in entries:
            entries[name] = {**row, "notebook": name, "link": None,
                             "error": (row.get("error") or "") + " (no executed copy)"}
    index = html_dir / "index.html"
    index.write_text(_index_html(sorted(entries.values(), key=lambda r: r["notebook"])), encoding="utf-8")
    return index


def _index_html(rows: list[dict]) -> str:
    def cell(v):
        return f"<td>{html.escape(str(v if v is not None else ''))}</td>"

    body = []
    for r in rows:
        status = str(r.get("status", "unknown"))
        name = html.escape(r["notebook"])
        link = f'<a href="{html.escape(r["link"])}">{name}</a>' if r.get("link") else name
        color = STATUS_COLORS.get(status, "#6e7781")
        body.append(
            f'<tr class="nb" data-notebook="{name}" data-status="{html.escape(status)}"><td>{link}</td>'
            f'<td class="status" style="color:{color};font-weight:bold">{html.escape(status)}</td>'
            + cell(r.get("seconds", "")) + cell(r.get("mode", "")) + cell(r.get("device", ""))
            + cell(r.get("error", "")) + "</tr>")
    passed = sum(r.get("status") == "pass" for r in rows)
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dsv4lab report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.3em 0.8em; text-align: left; vertical-align: top; }}
td:last-child {{ max-width: 40em; font-size: 85%; color: #555; }}
</style></head>
<body>
<h1>dsv4lab: executed notebooks</h1>
<p id="totals">{passed} of {len(rows)} notebooks passed. Built {html.escape(now)}.</p>
<table id="notebooks">
<thead><tr><th>notebook</th><th>status</th><th>seconds</th><th>mode</th><th>device</th><th>error</th></tr></thead>
<tbody>
{chr(10).join(body)}
</tbody></table>
</body></html>
"""
