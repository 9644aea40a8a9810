"""`vllm-overlay image build | verify | standin`: the ROCm image with the
series applied, checked from inside."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

from vllm_overlay.command import (
    App,
    Subparsers,
    add_command,
    add_subcommands,
    add_target_option,
)
from vllm_overlay.image.build import ImageError, build_image, default_tag
from vllm_overlay.image.engine import ENGINES, choose_engine
from vllm_overlay.image.rdma import TOY_PROXY
from vllm_overlay.image.standin import build_standin
from vllm_overlay.image.verify import (
    SERIES_MODES,
    format_verification,
    verify_install,
)
from vllm_overlay.tree.materialize import WHEEL_ENV
from vllm_overlay.tree.target import detect_target


def cmd_build(app: App, args: argparse.Namespace) -> int:
    """Build the image, check its labels and verify it from inside.

    Build docker/Dockerfile from the pinned base (or --base, or a local
    stand-in with --standin), FROM the base's digest when known; check the
    labels; run `image verify` in a container of the new image; push every
    tag with --push when all checks pass. docs/image.md has the details.
    """
    checkout = app.checkout
    base, tag, engine = args.base, args.tag, args.engine
    if args.standin:
        if args.dry_run:
            raise ImageError("--standin builds the stand-in first: no --dry-run")
        standin = make_standin(app, args)
        base, engine = standin.tag, standin.engine
        tag = tag or (
            f"localhost/{default_tag(checkout.pin, checkout.series, args.series)}"
            "-standin"
        )
    report = build_image(
        checkout.root,
        tag=tag,
        base=base,
        push=args.push,
        dry=args.dry_run,
        engine=engine,
        verify=not args.no_verify,
        record=args.record_digest,
        report_path=checkout.path(args.report) if args.report else None,
        say=app.say,
        mode=args.series,
        # The stand-in base has no MoRI, NIC provider or toy proxy.
        rdma=not args.standin,
    )
    if report is not None:
        app.result(report)
    return 0


def cmd_verify(app: App, args: argparse.Namespace) -> int:
    """Check this Python's vLLM is the pinned one, overlaid, and importable.

    Runs inside the image (the Dockerfile's last RUN step and the build
    driver do): every pinned file overlaid by this series, vllm.__version__
    the pin's, the patched connector imports, vLLM loads the banner plugin,
    the pinned vllm-router is installed. Exit status 0 only when all pass.
    """
    checkout = app.checkout
    vllm_dir = detect_target(args.target).root / "vllm" if args.target else None
    verification = verify_install(
        checkout.root, checkout.pin, checkout.series, vllm_dir, args.series,
        rdma=args.rdma, toy_proxy=args.toy_proxy,
    )  # fmt: skip
    app.say(format_verification(verification))
    app.result(verification)
    return 0 if verification.ok else 1


class Built(msgspec.Struct):
    tag: str
    engine: str
    reused: bool
    seconds: float


def make_standin(app: App, args: argparse.Namespace) -> Built:
    checkout = app.checkout
    wheel = args.wheel or _env_wheel()
    if wheel is None:
        raise ImageError(
            f"the stand-in needs the pinned vLLM wheel: --wheel or ${WHEEL_ENV}"
        )
    choice = choose_engine(args.engine)
    if choice.engine is None:
        raise ImageError(f"no container engine can build here: {choice.explain()}")
    app.say(f"engine: {choice.engine.describe()} ({choice.explain()})")
    standin = build_standin(
        checkout.root,
        checkout.pin,
        checkout.path(wheel),
        choice.engine,
        checkout.path(args.cache),
        say=app.say,
    )
    return Built(standin.tag, choice.engine.name, standin.reused, standin.seconds)


def cmd_standin(app: App, args: argparse.Namespace) -> int:
    """Build (once) a local stand-in for the pinned ROCm base image.

    A Debian-based stand-in for the pinned vllm/vllm-openai-rocm image, with
    vLLM installed the way that image installs it and CPU torch
    (docker/standin/Containerfile); local storage only, never pushed.
    Reused while its inputs are unchanged. Prints its tag.
    """
    built = make_standin(app, args)
    app.say(f"standin: {built.tag}{' (reused)' if built.reused else ''}")
    app.result(built)
    return 0


def _env_wheel() -> Path | None:
    value = os.environ.get(WHEEL_ENV)
    return Path(value) if value else None


def add_standin_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the stand-in base")
    g.add_argument(
        "--wheel",
        type=Path,
        metavar="WHEEL",
        help=f"the pinned vLLM wheel (default: ${WHEEL_ENV})",
    )
    g.add_argument(
        "--cache",
        type=Path,
        default=Path(".nox-cache/standin"),
        metavar="DIR",
        help="where its root filesystem and wheels are kept (default: %(default)s)",
    )


def add_series_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--series",
        choices=SERIES_MODES,
        default="apply",
        help="apply: the series overlaid (default); none: the same image with "
        "the banner plugin and the base's MoRIIO files, unpatched (the base of "
        "`e2e --ab`, tagged v<vLLM>-base)",
    )


def add_engine_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="the container engine (default: the first that works)",
    )


def register(sub: Subparsers) -> None:
    image = add_command(
        sub,
        "image",
        None,
        doc=(
            "The ROCm image: build it, verify it from inside, a local stand-in base.\n"
            "\n"
            "The pinned vLLM image with the series applied (docker/Dockerfile), "
            "built with docker, podman or buildah and checked from inside."
        ),
    )
    image_sub = add_subcommands(image, "image_command")
    p = add_command(image_sub, "build", cmd_build)
    p.add_argument(
        "--tag",
        metavar="IMAGE[:TAG]",
        help="REPO:TAG for exactly that tag; REPO for REPO:v<vLLM>-<series> and "
        "REPO:v<vLLM>-overlay (default REPO: vllm-moriio-overlay)",
    )
    which_base = p.add_mutually_exclusive_group()
    which_base.add_argument(
        "--base", metavar="IMAGE", help="build from this image instead of the pin's"
    )
    which_base.add_argument(
        "--standin",
        action="store_true",
        help="build from a local stand-in for the pinned base (`image standin`; "
        "built once, then reused)",
    )
    p.add_argument(
        "--push", action="store_true", help="push the tags when all checks pass"
    )
    add_series_option(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the engine choice, build args and commands",
    )
    add_engine_option(p)
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checks from inside the image",
    )
    p.add_argument(
        "--record-digest",
        action="store_true",
        help="write the pinned base's digest into pin.toml when it records none",
    )
    p.add_argument(
        "--report", type=Path, metavar="FILE", help="write the build report (JSON)"
    )
    add_standin_options(p)
    v = add_command(image_sub, "verify", cmd_verify)
    add_target_option(v)
    add_series_option(v)
    v.add_argument(
        "--rdma",
        action="store_true",
        help="also check that MoRI imports, libibverbs has a NIC provider and "
        "vLLM's MoRIIO toy proxy starts (the build driver asks this of a new image)",
    )
    v.add_argument(
        "--toy-proxy",
        default=TOY_PROXY,
        metavar="PATH",
        help="the toy proxy script --rdma starts (default: %(default)s)",
    )
    s = add_command(image_sub, "standin", cmd_standin)
    add_engine_option(s)
    add_standin_options(s)
