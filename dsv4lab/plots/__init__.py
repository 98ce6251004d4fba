"""Figures drawn from recorded rows (dsv4lab.results), one module per notebook family."""
