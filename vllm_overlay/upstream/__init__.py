"""Upstream: exporting each patch as a pull request (format-patch, PR body,
ported tests) and rebasing the series onto a newer vLLM."""
