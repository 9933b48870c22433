"""Helpers shared by the model and kernel tests."""
