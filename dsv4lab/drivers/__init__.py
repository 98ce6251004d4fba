"""Drivers: the decode step at real scale, tensor parallelism, and the analytic models."""
