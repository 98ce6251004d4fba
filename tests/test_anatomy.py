"""dsv4lab.anatomy (the decode step's bytes, FLOPs and roofline), its plots and explorer."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import anatomy, roofline
from dsv4lab.config import DSV4Config

FLASH = DSV4Config.flash()
MINI = DSV4Config.mini()
H200 = roofline.DEVICES["H200"]


def rows_of(cfg=FLASH, **kw):
    kw.setdefault("concurrency", 1)
    kw.setdefault("context", 32768)
    kw.setdefault("device", H200)
    return {r["component"]: r for r in anatomy.step_anatomy(cfg, **kw)}


def test_flash_parameter_count_matches_the_published_size():
    s = anatomy.model_summary(FLASH)
    assert 280e9 < s["params_total"] < 290e9       # DeepSeek-V4-Flash: 284B
    assert 12e9 < s["params_active"] < 15e9        # 13B active
    assert s["layer_kinds"] == {"ratio 0": 2, "ratio 4": 21, "ratio 128": 20}
    assert s["routed_expert_bytes"] == pytest.approx(s["params_routed_experts"] * (0.5 + 1 / 32))


def test_expected_unique_experts():
    assert anatomy.expected_unique_experts(0, 256, 6) == 0
    assert anatomy.expected_unique_experts(1, 256, 6) == pytest.approx(6)
    assert anatomy.expected_unique_experts(10_000, 256, 6) == pytest.approx(256)
    vals = [anatomy.expected_unique_experts(t, 256, 6) for t in range(0, 200, 7)]
    assert all(a < b for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError):
        anatomy.expected_unique_experts(1, 8, 9)


def test_expected_unique_experts_against_simulation():
    rng = np.random.default_rng(0)
    E, k, T, trials = 16, 2, 5, 4000
    hits = [len({e for _ in range(T) for e in rng.choice(E, k, replace=False)}) for _ in range(trials)]
    # standard error ~ 0.02; 0.1 leaves a wide margin
    assert np.mean(hits) == pytest.approx(anatomy.expected_unique_experts(T, E, k), abs=0.1)


def test_attended_entries_per_layer_kind():
    assert anatomy.attended_entries(FLASH, 0, 50) == 50
    assert anatomy.attended_entries(FLASH, 0, 32768) == 128
    assert anatomy.attended_entries(FLASH, 4, 32768) == 128 + 512          # top-512 of 8192
    assert anatomy.attended_entries(FLASH, 4, 1000) == 128 + 250
    assert anatomy.attended_entries(FLASH, 128, 32768) == 128 + 256        # every c128 entry


def test_attention_bytes_follow_the_kv_layout():
    r = rows_of(concurrency=3, context=32768)
    n4 = sum(x == 4 for x in FLASH.compress_ratios[:43])
    kv = 3 * n4 * (128 + 512 + 1) * anatomy.KV_ENTRY_BYTES
    io = 3 * n4 * 64 * 1024 * 2
    assert r["attention (c4)"]["bytes"] == pytest.approx(kv + io)
    assert r["attention (c4)"]["flops"] == pytest.approx(2 * 3 * 64 * 1024 * (128 + 512) * n4)


def test_indexer_fallback_scores_max_context_triton_the_actual_one():
    tri = [rows_of(context=c, max_context=m, indexer="triton")["indexer"]["bytes"]
           for c, m in ((8192, 2 ** 20), (8192, 2 ** 19), (16384, 2 ** 20))]
    fb = [rows_of(context=c, max_context=m, indexer="fallback")["indexer"]["bytes"]
          for c, m in ((8192, 2 ** 20), (8192, 2 ** 19), (16384, 2 ** 20))]
    assert tri[0] == tri[1]                      # triton: max context does not matter
    assert tri[2] > 1.9 * tri[0]                 # ... the actual context does
    assert fb[0] == fb[2]                        # fallback: context does not matter
    assert fb[0] > 1.9 * fb[1]                   # ... max context does
    assert fb[0] > 100 * tri[0]
    assert rows_of(context=8192, indexer="fallback")["indexer"]["dtype"] == "fp8"


def test_routed_moe_bytes_at_concurrency_one():
    r = rows_of(concurrency=1)["routed MoE"]
    ep = 3 * 4096 * 2048
    weights = 43 * 6 * ep * (0.5 + 1 / 32)
    assert weights < r["bytes"] < weights * 1.01          # plus a few activations
    assert r["flops"] == pytest.approx(2 * 6 * ep * 43)


def test_weight_formats_order():
    b = {f: rows_of(concurrency=8, weight_format=f)["routed MoE"]["bytes"] for f in anatomy.WEIGHT_FORMATS}
    assert b["mxfp4"] < b["nvfp4"] < b["fp8"] < b["bf16"]
    with pytest.raises(ValueError, match="weight_format"):
        rows_of(weight_format="int4")


def test_rows_are_consistent():
    rows = anatomy.step_anatomy(FLASH, concurrency=64, context=65536, device=H200)
    assert {r["group"] for r in rows} == set(anatomy.GROUPS)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    for r in rows:
        assert r["bytes"] > 0 and r["flops"] > 0
        assert r["intensity"] == pytest.approx(r["flops"] / r["bytes"])
        peak = H200.fp8_flops if r["dtype"] == "fp8" else H200.bf16_flops
        # the sum of per-layer roofs is at least the roof of the sum, and equal for identical layers
        assert r["roofline_s"] >= roofline.roofline_time(r["bytes"], r["flops"], H200, dtype=r["dtype"]) * (1 - 1e-9)
        assert r["bound"] == ("memory" if r["bytes"] / H200.bandwidth >= r["flops"] / peak else "compute")
    t = anatomy.step_totals(rows)
    assert t["roofline_s"] == pytest.approx(sum(r["roofline_s"] for r in rows))
    assert t["tokens_per_s"] == pytest.approx(64 / t["roofline_s"])
    assert t["largest"] == "routed MoE"


def test_computed_from_the_config_not_typed_in():
    base = rows_of(concurrency=16)
    more = rows_of(FLASH.replace(n_experts_per_tok=8), concurrency=16)
    assert more["routed MoE"]["flops"] == pytest.approx(base["routed MoE"]["flops"] * 8 / 6)
    wide = rows_of(FLASH.replace(window_size=256), concurrency=16)
    assert wide["attention (window)"]["bytes"] > base["attention (window)"]["bytes"]
    assert rows_of(FLASH.replace(hc_mult=2), concurrency=16)["mHC"]["bytes"] < base["mHC"]["bytes"]


def test_device_changes_only_the_time():
    h = rows_of(concurrency=8, device="H200")
    b = rows_of(concurrency=8, device="B200")
    for k in h:
        assert h[k]["bytes"] == b[k]["bytes"] and h[k]["roofline_s"] > b[k]["roofline_s"]
        assert b[k]["device"] == "B200"


@pytest.mark.parametrize("kw, match", [
    (dict(concurrency=0), "concurrency"), (dict(context=0), "context"),
    (dict(context=4096, max_context=2048), "max_context"), (dict(indexer="capped"), "indexer"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        rows_of(**kw)


def test_mini_config_and_tables():
    rows = anatomy.step_anatomy(MINI, concurrency=3, context=100)
    assert {r["component"] for r in rows} >= {"attention (window)", "attention (c4)", "attention (c128)", "indexer"}
    text = anatomy.format_table(rows)
    assert "routed MoE" in text and "tokens/s" in text
    assert anatomy.html_table(rows).count("<tr>") == len(rows) + 2 and "<table" in anatomy.html_table(rows)
    assert list(anatomy.by_group(rows)) == list(anatomy.GROUPS)
    with pytest.raises(ValueError):
        anatomy.step_totals([])


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 512), c=st.integers(1, 2 ** 20), extra=st.integers(0, 2 ** 20),
       idx=st.sampled_from(anatomy.INDEXERS))
def test_monotone_in_concurrency_and_context(t, c, extra, idx):
    m = min(c + extra, 2 ** 21)
    a = rows_of(concurrency=t, context=c, max_context=m, indexer=idx)
    b = rows_of(concurrency=t + 1, context=c, max_context=m, indexer=idx)
    d = rows_of(concurrency=t, context=min(c * 2, m), max_context=m, indexer=idx)
    for k in a:
        assert all(math.isfinite(a[k][f]) and a[k][f] > 0 for f in ("bytes", "roofline_s"))
        assert a[k]["flops"] >= 0          # the indexer scores nothing below 4 tokens
        assert b[k]["bytes"] >= a[k]["bytes"] and b[k]["flops"] >= a[k]["flops"]
        assert d[k]["bytes"] >= a[k]["bytes"]


# ---- the tour's plots and explorer ----------------------------------------------------

def test_plots_draw_and_tolerate_nothing():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4lab.plots import tour

    steps = {f"concurrency {c}": anatomy.step_anatomy(FLASH, concurrency=c, context=4096) for c in (1, 64)}
    fig = tour.plot_anatomy(steps, device="H200")
    roof_ax, bar_ax = fig.axes[:2]
    assert "H200" in roof_ax.get_title()
    assert len(bar_ax.patches) == 2 * len(anatomy.GROUPS)
    assert tour.figure_png(fig)[:4] == b"\x89PNG"
    plt.close(fig)
    for fn in (tour.plot_roofline, tour.plot_stacked):
        ax = fn({})
        assert "no anatomy rows" in ax.texts[0].get_text()
        plt.close(ax.figure)


def test_explorer_recomputes_when_a_control_moves():
    pytest.importorskip("ipywidgets")
    from dsv4lab.widgets import tour

    ex = tour.explorer(FLASH, concurrency=64, context=32768, device="H200", figure=False)
    first = ex.summary.value
    assert "concurrency 64" in first and "H200" in first
    ex.concurrency.value = 1
    assert ex.summary.value != first and "concurrency 1," in ex.summary.value
    assert ex.rows[0]["concurrency"] == 1
    before = ex.table.value
    ex.indexer.value = "fallback"
    assert ex.table.value != before and ex.rows[0]["indexer"] == "fallback"
    ex.max_context.value = 4096
    assert ex.settings()["context"] == 4096          # context clamped to max context
    assert "clamped" in ex.summary.value


def test_explorer_has_a_static_fallback():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib").use("Agg")
    from dsv4lab.widgets import tour

    ex = tour.explorer(MINI, concurrency=4, context=1024, device="H200")
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert tour.SUMMARY_CLASS in bundle["text/html"] and "<table" in bundle["text/html"]
    assert "data:image/png;base64," in bundle["text/html"]
