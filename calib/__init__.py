"""Calibration data, observers and statistics hooks."""
