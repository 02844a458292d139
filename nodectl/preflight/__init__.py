"""Preflight: probe every node (remote), judge the reports (pure), run a short collective test (launch path)."""
