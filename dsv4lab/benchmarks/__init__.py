"""Benchmark definitions, one module per family; importing this package registers them all.

A module that fails to import does not take the others down: its benchmarks are noted as
unavailable with the error (``dsv4lab bench --help`` and ``dsv4lab bench NAME`` say why),
and tests/test_bench.py checks that none is.

    from dsv4lab import benchmarks
    rows = benchmarks.run("sparse_mla", smoke=True)     # the rows, with their provenance
"""
import importlib
import pkgutil

from dsv4lab import bench

for _mod in pkgutil.iter_modules(__path__):
    try:
        importlib.import_module(f"{__name__}.{_mod.name}")
    except Exception as _e:  # noqa: BLE001  (reported per benchmark, not raised at import)
        bench.unavailable(_mod.name, f"{type(_e).__name__}: {_e}")


def registered() -> dict:
    """{name: :class:`dsv4lab.bench.Benchmark`} of every benchmark that imported."""
    return bench.registered()


def unavailable() -> dict[str, str]:
    """{name: why} of the definition modules that failed to import."""
    return bench.unavailable_reasons()


def run(name: str, *, smoke: bool = False, record: bool | None = None, **options) -> list[dict]:
    """:func:`dsv4lab.bench.run` with every definition registered."""
    return bench.run(name, smoke=smoke, record=record, **options)
