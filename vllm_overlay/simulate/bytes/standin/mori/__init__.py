"""Loopback stand-in for AMD's ``mori`` (``amd-mori``), simulator only.

Not mori. The simulator puts this directory first on ``sys.path`` of its own
processes so that vLLM's MoRIIO connector imports ``mori.io`` from here; it is
never installed into an environment or an image. Only ``mori.io`` exists.
"""
