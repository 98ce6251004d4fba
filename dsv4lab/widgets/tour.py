"""The decode-step explorer: move concurrency, context or max context, see the step change.

Every change recomputes :func:`dsv4lab.anatomy.step_anatomy` and redraws the summary, the
table and the figure. Headless (papermill, nbconvert) a widget cannot be drawn, so the
explorer's display also carries a static HTML fallback (the summary, the table and a PNG
of the figure at the initial settings); JupyterLab shows the live widget instead, and
HTML exports without widget state show the fallback. Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import base64
import html

import ipywidgets as W
import matplotlib.pyplot as plt

from dsv4lab import anatomy, roofline
from dsv4lab.config import DSV4Config
from dsv4lab.plots import tour as tour_plots

SUMMARY_CLASS = "dsv4lab-anatomy-summary"   # browser tests find the summary by this class


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    if not out or out[-1] != hi:
        out.append(hi)
    return out


def _pick(options: list[int], value: int) -> int:
    return min(options, key=lambda o: abs(o - value))


def summary_text(rows: list[dict]) -> str:
    """One line: step time at the roof, tokens/s, the largest component."""
    t = anatomy.step_totals(rows)
    return (f"{t['device']} roofline: {t['step_ms']:.2f} ms per step, {t['tokens_per_s']:,.0f} tokens/s "
            f"at concurrency {t['concurrency']}, context {t['context']:,}, max context "
            f"{t['max_context']:,}, indexer {t['indexer']}; largest: {t['largest']} "
            f"({t['largest_share'] * 100:.0f}%)")


def static_html(rows: list[dict], *, device=None, figure: bool = True) -> str:
    """The headless fallback: summary, table, and the figure as an inline PNG."""
    parts = [f'<p class="{SUMMARY_CLASS}">{html.escape(summary_text(rows))}</p>', anatomy.html_table(rows)]
    if figure:
        fig = tour_plots.plot_anatomy({f"concurrency {rows[0]['concurrency']}": rows}, device=device)
        png = base64.b64encode(tour_plots.figure_png(fig)).decode()
        plt.close(fig)
        parts.append(f'<img alt="decode step anatomy" src="data:image/png;base64,{png}"/>')
    return "<div>" + "".join(parts) + "</div>"


class AnatomyExplorer(W.VBox):
    """Sliders for concurrency, context and max context, an indexer toggle, and the
    summary (``.summary``, an HTML widget), table and figure they drive."""

    def __init__(self, cfg: DSV4Config | None = None, *, concurrency: int = 64, context: int = 32768,
                 max_context: int | None = None, indexer: str = "triton", device=None,
                 figure: bool = True):
        self.cfg = cfg or DSV4Config.flash()
        self.spec = device if isinstance(device, roofline.DeviceSpec) else roofline.device_spec(device)
        self.figure = figure
        top = self.cfg.max_position_embeddings
        ctx_opts = _powers_of_two(min(1024, top), top)
        style = {"description_width": "110px"}
        layout = W.Layout(width="520px")
        self.concurrency = W.SelectionSlider(options=_powers_of_two(1, 1024),
                                             value=_pick(_powers_of_two(1, 1024), concurrency),
                                             description="concurrency", style=style, layout=layout,
                                             continuous_update=False)
        self.context = W.SelectionSlider(options=ctx_opts, value=_pick(ctx_opts, context),
                                         description="context", style=style, layout=layout,
                                         continuous_update=False)
        self.max_context = W.SelectionSlider(options=ctx_opts,
                                             value=_pick(ctx_opts, max_context or top),
                                             description="max context", style=style, layout=layout,
                                             continuous_update=False)
        self.indexer = W.ToggleButtons(options=list(anatomy.INDEXERS), value=indexer,
                                       description="indexer", style=style)
        self.summary = W.HTML()
        self.summary.add_class(SUMMARY_CLASS)
        self.table = W.HTML()
        self.plot = W.Output()
        self.rows: list[dict] = []
        super().__init__([self.concurrency, self.context, self.max_context, self.indexer,
                          self.summary, self.table, self.plot])
        for control in (self.concurrency, self.context, self.max_context, self.indexer):
            control.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, change):
        self.update()

    def settings(self) -> dict:
        ctx, mx = self.context.value, self.max_context.value
        return {"concurrency": self.concurrency.value, "context": min(ctx, mx), "max_context": mx,
                "indexer": self.indexer.value}

    def update(self) -> list[dict]:
        """Recompute the anatomy from the controls and redraw everything."""
        s = self.settings()
        self.rows = anatomy.step_anatomy(self.cfg, device=self.spec, **s)
        note = "" if self.context.value <= s["max_context"] else \
            f" (context clamped to max context {s['max_context']:,})"
        self.summary.value = f"<b>{html.escape(summary_text(self.rows) + note)}</b>"
        self.table.value = anatomy.html_table(self.rows)
        if self.figure:
            with self.plot:
                self.plot.clear_output(wait=True)
                fig = tour_plots.plot_anatomy({f"concurrency {s['concurrency']}": self.rows}, device=self.spec)
                from IPython.display import display
                display(fig)
                plt.close(fig)
        return self.rows

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/html"] = static_html(self.rows, device=self.spec, figure=self.figure)
        return data


def explorer(cfg: DSV4Config | None = None, **kwargs) -> AnatomyExplorer:
    """The decode-step explorer (live in JupyterLab, static HTML when headless)."""
    return AnatomyExplorer(cfg, **kwargs)
