"""The one base class of every error the CLI reports as a single line."""


class OverlayError(Exception):
    """Bad input or an unusable tree: reported as one line, exit status 2."""
