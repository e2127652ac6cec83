"""Policies made by the project's own code (nothing is downloaded)."""
