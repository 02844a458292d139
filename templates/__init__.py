"""Jinja2 templates rendered per node."""
