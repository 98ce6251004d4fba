"""ipywidgets explorers; each recomputes from dsv4lab when a control moves and has a
static fallback (a table or figure) when a notebook runs headless."""
