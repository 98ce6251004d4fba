"""The indexer explorer: slide max context and actual length, see each backend's cost.

Moving a slider recomputes :func:`dsv4lab.plots.indexer.estimate_us` (a line through the
recorded H200 rows, or the HBM roofline when there are none) and the share of a decode
step the indexer eats. Headless (papermill, nbconvert) the display also carries a static
HTML table at the initial settings. Explained in notebooks/03_indexer_capping.ipynb.
"""
from __future__ import annotations

import html

import ipywidgets as W

from dsv4lab.plots import indexer as P

SUMMARY_CLASS = "dsv4lab-indexer-summary"
TOKENS = [2 ** i for i in range(9, 21)]        # 512 .. 1,048,576 tokens


def table_html(rows, max_context_tokens: int, actual_tokens: int, *, batch: int = 64) -> str:
    """The summary and one table row per backend, for the given settings."""
    actual = min(actual_tokens, max_context_tokens)
    est = P.estimate_us(rows, max_context_tokens, actual, batch=batch)
    lines = [f'<p class="{SUMMARY_CLASS}">B={batch}, max context {max_context_tokens:,} tokens '
             f'({max_context_tokens // P.COMPRESS:,} entries), actual {actual:,} tokens '
             f'({actual // P.COMPRESS:,} entries)</p>',
             "<table><tr><th>backend</th><th>us per call</th><th>% of decode step</th>"
             "<th>source</th></tr>"]
    for be, (us, how) in est.items():
        lines.append(f"<tr><td>{html.escape(be)}</td><td>{us:,.1f}</td>"
                     f"<td>{100 * P.decode_share(us):.1f}</td><td>{html.escape(how)}</td></tr>")
    lines.append("</table>")
    return "".join(lines)


class IndexerExplorer(W.VBox):
    """Two sliders (max context, actual length, in tokens) driving ``.out`` (HTML)."""

    def __init__(self, rows=(), *, max_context: int = 1048576, actual: int = 512,
                 batch: int = 64):
        self.rows = list(rows)
        self.batch = batch
        style = {"description_width": "140px"}
        layout = W.Layout(width="560px")
        self.max_context = W.SelectionSlider(options=TOKENS, value=max_context,
                                             description="max context (tok)", style=style,
                                             layout=layout, continuous_update=False)
        self.actual = W.SelectionSlider(options=TOKENS, value=min(actual, max_context),
                                        description="actual length (tok)", style=style,
                                        layout=layout, continuous_update=False)
        self.out = W.HTML()
        self.max_context.observe(self._update, names="value")
        self.actual.observe(self._update, names="value")
        super().__init__([self.max_context, self.actual, self.out])
        self._update()

    def _update(self, *_):
        if self.actual.value > self.max_context.value:
            self.actual.value = self.max_context.value      # re-enters _update
            return
        self.out.value = table_html(self.rows, self.max_context.value, self.actual.value,
                                    batch=self.batch)

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/html"] = self.out.value        # the static fallback when headless
        return data


def explorer(rows=(), **kw) -> IndexerExplorer:
    """An :class:`IndexerExplorer` over recorded ``results.load("indexer")`` rows."""
    return IndexerExplorer(rows, **kw)
