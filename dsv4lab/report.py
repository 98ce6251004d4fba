"""``dsv4lab report``: executed notebooks to HTML, with an index page.

:func:`build_report` converts every executed notebook in ``executed_dir`` (what
``dsv4lab run`` wrote to build/notebooks/) to ``html_dir/<name>.html`` with nbconvert,
and writes ``html_dir/index.html``: one row per notebook with its title and one-line
summary (from its first markdown cell), its status, mode, time and device from
``summary.json`` (or, for a notebook run some other way, from the papermill metadata
inside it), and a link that resolves. Notebooks listed in the summary without an executed
copy are listed too, without a link. The rendered code cells leave out the
``# NBVAL_...`` marker comments (instructions to the notebook tests, not to a reader).

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import re
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
NBVAL_MARKER = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+[ \t]*(?:\n|$)", re.M)
SUMMARY_CHARS = 240


def _plain_markdown(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)        # [text](url) -> text
    return re.sub(r"\*\*|__|`", "", text).strip()


def title_and_summary(nb) -> tuple[str, str]:
    """The first markdown cell's heading, and the first sentence after it (at least 40
    characters; the first list item when the paragraph only leads into a list, as "What you
    will learn:" does)."""
    md = next((c.source for c in nb.cells if c.cell_type == "markdown" and c.source.strip()), "")
    title, paras = "", []
    for block in re.split(r"\n\s*\n", md):
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        if not lines:
            continue
        if lines[0].startswith("#") and not title:
            title = lines[0].lstrip("#").strip()
            lines = lines[1:]
        if lines:
            paras.append(lines)
    summary = ""
    for lines in paras:
        items = [i for i, ln in enumerate(lines) if re.match(r"^([-*+]|\d+\.)\s", ln)]
        lead = " ".join(lines[:items[0]] if items else lines)
        if lead.rstrip().endswith(":"):            # "... You will learn:" leads into a list
            lead = " ".join(re.split(r"(?<=[.!?])\s+", lead)[:-1])
        if lead:
            summary = lead
            break
        if items:                                   # a lead-in to a list: its first item
            item = [re.sub(r"^([-*+]|\d+\.)\s+", "", lines[items[0]])]
            item += [ln for ln in lines[items[0] + 1:items[1] if len(items) > 1 else None]]
            summary = " ".join(item)
            break
    summary = _plain_markdown(summary)
    cut = re.search(r"(?<=[.!?])\s", summary[40:])
    if cut:
        summary = summary[:40 + cut.start()]
    if len(summary) > SUMMARY_CHARS:
        summary = summary[:SUMMARY_CHARS - 1].rsplit(" ", 1)[0] + "\u2026"
    return _plain_markdown(title), summary.rstrip(";,")


def _strip_nbval_markers(nb) -> None:
    """Drop the ``# NBVAL_...`` comment lines from the code cells (they steer the notebook tests)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "NBVAL_" in cell.source:
            cell.source = NBVAL_MARKER.sub("", cell.source)


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
    _strip_nbval_markers(nb)
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": nb_path.stem}})
    out_path.write_text(body, encoding="utf-8")
    return nb


def _read_titles(path: Path) -> tuple[str, str]:
    import nbformat
    try:
        return title_and_summary(nbformat.read(path, as_version=4))
    except Exception:  # noqa: BLE001  (an unreadable notebook has no title; the row says why)
        return "", ""


def build_report(executed_dir, html_dir, source_dir=None) -> Path:
    """Convert ``executed_dir/*.ipynb`` to ``html_dir/*.html``; return the index's path.
    ``source_dir`` (the committed notebooks) gives the titles of notebooks the summary
    lists without an executed copy."""
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
        title, line = _read_titles(nb_path)
        try:
            nb = _convert(nb_path, target)
            link = target.name
            if not row:
                row = _status_from_notebook(nb)
        except Exception as e:  # an unreadable notebook is reported, not fatal
            link = None
            row = {**row, "status": row.get("status", "fail"),
                   "error": (row.get("error") or "") + f" (HTML conversion failed: {type(e).__name__}: {e})"}
        entries[name] = {**row, "notebook": name, "link": link, "title": title, "summary": line}
    for name, row in summary.items():
        if name not in entries:
            src = Path(source_dir) / f"{name}.ipynb" if source_dir else None
            title, line = _read_titles(src) if src is not None and src.exists() else ("", "")
            entries[name] = {**row, "notebook": name, "link": None, "title": title, "summary": line,
                             "error": (row.get("error") or "") + " (no executed copy)"}
    index = html_dir / "index.html"
    index.write_text(_index_html(sorted(entries.values(), key=lambda r: r["notebook"])), encoding="utf-8")
    return index


def _index_html(rows: list[dict]) -> str:
    def cell(v, cls=""):
        attr = f' class="{cls}"' if cls else ""
        return f"<td{attr}>{html.escape(str(v if v is not None else ''))}</td>"

    body = []
    for r in rows:
        status = str(r.get("status", "unknown"))
        name = html.escape(r["notebook"])
        title = html.escape(r.get("title") or r["notebook"])
        link = f'<a href="{html.escape(r["link"])}">{title}</a>' if r.get("link") else title
        color = STATUS_COLORS.get(status, "#6e7781")
        body.append(
            f'<tr class="nb" data-notebook="{name}" data-status="{html.escape(status)}">'
            f'<td class="title">{link}<div class="summary">{html.escape(r.get("summary") or "")}</div></td>'
            f'<td class="status" style="color:{color};font-weight:bold">{html.escape(status)}</td>'
            + cell(r.get("seconds", "")) + cell(r.get("mode", "")) + cell(r.get("device", ""))
            + cell(r.get("error", ""), "error") + "</tr>")
    passed = sum(r.get("status") == "pass" for r in rows)
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dsv4lab report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.3em 0.8em; text-align: left; vertical-align: top; }}
td.title {{ max-width: 36em; }}
td.title a {{ font-weight: bold; }}
.summary {{ font-size: 90%; color: #444; margin-top: 0.2em; }}
td.error {{ max-width: 30em; font-size: 85%; color: #555; }}
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
