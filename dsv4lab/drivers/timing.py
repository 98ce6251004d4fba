"""Timing a decode step component by component: marks between components, one CUDA graph.

A driver's ``run(state, mark)`` calls ``mark(layer, component)`` after each component. With
:class:`Marks` of kind ``"graph_events"`` the marks are CUDA events recorded inside the
graph (``torch.cuda.Event(external=True)``), so every replay times every component and the
components add up to the step by construction. ``"events"`` records the same events
eagerly (host gaps included: what an eager call costs), ``"wall"`` takes wall-clock times
(the CPU and Triton's interpreter: they say nothing about a GPU).

Shared by :mod:`dsv4lab.drivers.step` and :mod:`dsv4lab.drivers.tp`.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from dsv4lab import runtime

MARK_KINDS = ("wall", "events", "graph_events")


class Marks:
    """Called as ``mark(layer, component)`` after each component: closes a segment."""

    def __init__(self, kind: str):
        if kind not in MARK_KINDS:
            raise ValueError(f"kind must be one of {MARK_KINDS}, got {kind!r}")
        self.kind = kind
        self.names: list[tuple] = []
        self.points: list = []

    def _point(self):
        if self.kind == "wall":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True, external=True) if self.kind == "graph_events" \
            else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self):
        self.names.clear()
        self.points = [self._point()]

    def __call__(self, layer, component: str):
        self.points.append(self._point())
        self.names.append((layer, component))

    def segments(self) -> list[tuple]:
        """[(layer, component, ms)] of the last run (after the GPU finished it)."""
        out = []
        for i, name in enumerate(self.names):
            a, b = self.points[i], self.points[i + 1]
            ms = (b - a) * 1e3 if self.kind == "wall" else a.elapsed_time(b)
            out.append((name[0], name[1], float(ms)))
        return out


def no_mark(*args):
    """The mark of an untimed run."""
    return None


def capture(run: Callable, state, marks: Marks | None, *, free_cache: bool = True):
    """A CUDA graph of ``run(state, marks)`` (``marks.begin()`` first; ``run(state)`` when
    ``marks`` is None), after one warm-up ``run(state)`` on a side stream and a sync (and
    ``torch.cuda.empty_cache()`` when ``free_cache``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(state)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if free_cache:
        torch.cuda.empty_cache()
    g = torch.cuda.CUDAGraph()
    with runtime.cuda_graph_capture(g):
        if marks is not None:
            marks.begin()
            run(state, marks)
        else:
            run(state)
    return g


def segment_medians(samples) -> dict:
    """{(layer, component): median ms over the samples}, each sample's segments of the same
    (layer, component) summed first."""
    acc: dict = {}
    for seg in samples:
        per: dict = {}
        for layer, comp, ms in seg:
            per[(layer, comp)] = per.get((layer, comp), 0.0) + ms
        for k, v in per.items():
            acc.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in acc.items()}


def mode_of(timing: str) -> str:
    """A row's ``mode``: "graph" when the step was replayed from a CUDA graph (its components
    timed inside it, or shared out of its replay time), else "eager"."""
    return "graph" if timing in ("cuda_graph_events", "eager_event_shares_x_cuda_graph") else "eager"
