"""The series: the pin of the base, the patch files and their headers, and
the unified-diff reader that applies them exactly."""
