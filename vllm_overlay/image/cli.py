"""`vllm-overlay image`: the ROCm image with the series applied."""

from __future__ import annotations

import argparse

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.image.build import ENGINES, run_image


def cmd_image(app: App, args: argparse.Namespace) -> int:
    """Build the ROCm image: the pinned base with the series applied.

    Build (and push) the ROCm image from docker/Dockerfile: the pinned vLLM
    image with the series applied, labelled with the series. Builds with
    docker, podman or buildah.
    """
    return run_image(
        app.checkout.root, args.tag, args.push, args.dry_run, args.engine, say=app.say
    )


def register(sub: Subparsers) -> None:
    p = add_command(sub, "image", cmd_image)
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="the container engine (default: the first that works)",
    )
    p.add_argument(
        "--tag", metavar="IMAGE:TAG", help="image tag (default: from the pin)"
    )
    p.add_argument("--push", action="store_true", help="push the tag after building")
    p.add_argument(
        "--dry-run", action="store_true", help="print the commands and build args"
    )
