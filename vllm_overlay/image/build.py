"""`vllm-overlay image build`: the ROCm image with the series, built and then
checked from inside.

The steps, each printed as it runs:

1. choose the engine (docker, podman, buildah; the notes say why);
2. the base: the pin's `[image] reference` (or `--base`), fully qualified;
   pulled as its own step when it is not present; its manifest digest read
   back when the pin does not record one (`--record-digest` writes it there);
3. build docker/Dockerfile with build args from the pin, the series and git,
   FROM the base by digest when the digest is known; the wall time printed;
4. check the labels the engine recorded against those build args;
5. run `vllm-overlay image verify` in a container of the new image;
6. push, only when every check passed and `--push` was given.

`--dry-run` prints the engine choice, the build args and every command.

`--series none` builds the same image without the series (the A/B base of
`e2e --ab`): the banner plugin is installed, the MoRIIO files stay the
base's (build arg OVERLAY_SERIES=none), the check from inside requires
them untouched; the series labels say `none`, the tag is `v<vLLM>-base`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from vllm_overlay import __version__
from vllm_overlay.errors import OverlayError
from vllm_overlay.image.engine import Choice, Engine, Probe, Which, choose_engine
from vllm_overlay.image.engine import probe_info as _probe_info
from vllm_overlay.image.verify import SeriesMode, Verification, format_verification
from vllm_overlay.series.imageref import (
    ImageReference,
    ImageReferenceError,
    parse_reference,
)
from vllm_overlay.series.patch_series import Series, load_series
from vllm_overlay.series.pin import PIN_FILE, ImageRef, Pin, encode_pin, load_pin

DOCKERFILE = "docker/Dockerfile"
IMAGE_NAME = "vllm-moriio-overlay"
# Where the Dockerfile puts this checkout inside the image.
IMAGE_REPO = "/opt/vllm-moriio-overlay"
VERIFY = ("vllm-overlay", "--repo", IMAGE_REPO, "image", "verify", "--json")
BASE_TAG = "base"  # the tag suffix of a `--series none` build


def verify_command(mode: SeriesMode, rdma: bool = True) -> list[str]:
    """`image verify` as run in a container of the new image (``rdma``: with
    MoRI, a libibverbs provider and the toy proxy; not on the stand-in
    base, which has none of them)."""
    series = ["--series", mode] if mode != "apply" else []
    return [*VERIFY, *series, *(["--rdma"] if rdma else [])]


Say = Callable[[str], None]


class ImageError(OverlayError):
    """No engine can build, or a step of the build failed."""


class ImageReport(msgspec.Struct):
    tag: str  # the first of tags: the one checked
    tags: list[str]
    engine: str
    base_name: str
    base_digest: str
    build_seconds: float
    size: str
    labels: dict[str, str]
    label_problems: list[str]
    verification: Verification | None
    pushed: bool

    @property
    def ok(self) -> bool:
        verified = self.verification is None or self.verification.ok
        return verified and not self.label_problems


CA_ENV = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")


def build_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The build machine's CA bundle for pip in the build (secret
    `pip-cert`), when its environment names one: behind a TLS-intercepting
    proxy, pip in the base image does not trust PyPI otherwise."""
    env = os.environ if environ is None else environ
    for name in CA_ENV:
        path = env.get(name, "")
        if path and Path(path).is_file():
            return {"pip-cert": path}
    return {}


def git(repo: Path, *args: str) -> str:
    """One git query; empty when git or the repository is unavailable."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def revision(repo: Path) -> str:
    rev = git(repo, "rev-parse", "HEAD")
    if rev and git(repo, "status", "--porcelain", "--untracked-files=no"):
        rev += "-dirty"
    return rev


def base_reference(pin: Pin, base: str | None) -> ImageReference:
    """The base to build from, fully qualified, with the pin's digest when
    it is the pin's image and the pin records one."""
    if base is not None:
        return parse_reference(base).qualified()
    ref = parse_reference(pin.image.reference).qualified()
    return ref.with_digest(pin.image.digest) if pin.image.digest else ref


def build_args(
    repo: Path,
    pin: Pin,
    series: Series,
    base: ImageReference,
    mode: SeriesMode = "apply",
) -> dict[str, str]:
    """Every build arg of docker/Dockerfile, in a stable order. BASE_IMAGE
    is what FROM pulls (by digest when known); BASE_NAME and BASE_DIGEST
    become the `org.opencontainers.image.base.*` labels; OVERLAY_SERIES
    says whether the series is applied (`none`: the A/B base)."""
    name = ImageReference(base.registry, base.path, base.tag)
    applied = mode == "apply"
    return {
        "BASE_IMAGE": base.by_digest() if base.digest else str(base),
        "BASE_NAME": str(name),
        "BASE_DIGEST": base.digest,
        "VCS_SOURCE": git(repo, "remote", "get-url", "origin"),
        "VCS_REVISION": revision(repo),
        "VLLM_VERSION": pin.vllm.version,
        "VLLM_COMMIT": pin.vllm.git_commit,
        "SERIES_ID": series.series_id if applied else "none",
        "SERIES_PATCHES": ",".join(p.slug for p in series.patches) if applied else "",
        "OVERLAY_VERSION": __version__,
        "OVERLAY_SERIES": mode,
    }


# The label each build arg must become (the Dockerfile's LABEL instruction).
LABELS = {
    "org.opencontainers.image.base.name": "BASE_NAME",
    "org.opencontainers.image.base.digest": "BASE_DIGEST",
    "org.opencontainers.image.source": "VCS_SOURCE",
    "org.opencontainers.image.revision": "VCS_REVISION",
    "org.opencontainers.image.version": "OVERLAY_VERSION",
    "ai.vllm.version": "VLLM_VERSION",
    "ai.vllm.commit": "VLLM_COMMIT",
    "ai.vllm.moriio-overlay.series.id": "SERIES_ID",
    "ai.vllm.moriio-overlay.series.patches": "SERIES_PATCHES",
}


def build_labels(args: dict[str, str]) -> dict[str, str]:
    """The labels that hold build args, also passed as `--label`: buildah
    1.28 takes a LABEL step from its cache when only the ${ARG} values in it
    changed, and would keep the previous build's revision and series."""
    return {label: args[arg] for label, arg in LABELS.items()}


def label_problems(labels: dict[str, str], args: dict[str, str]) -> list[str]:
    """Every label that does not hold its build arg's value."""
    return [
        f"label {label} is {labels.get(label)!r}, expected {args[arg]!r}"
        for label, arg in LABELS.items()
        if labels.get(label) != args[arg]
    ]


MOVING_TAG = "overlay"


def image_tags(
    tag: str | None, pin: Pin, series: Series, mode: SeriesMode = "apply"
) -> list[str]:
    """The tags a build applies. `--tag REPO:TAG`: exactly that one. No
    `--tag`, or `--tag REPO` without a tag: two in REPO (default
    `vllm-moriio-overlay`): `v<vLLM>-<series id>`, one series that never
    moves, and `v<vLLM>-overlay`, the latest build for that vLLM (what the
    example E2E configs name; the E2E banner check tells which series ran)."""
    repo = IMAGE_NAME
    if tag:
        ref = parse_reference(tag)
        if ref.tag or ref.digest:
            return [tag]
        repo = tag
    version = f"v{pin.vllm.version}"
    if mode == "none":
        return [f"{repo}:{version}-{BASE_TAG}"]
    return [f"{repo}:{version}-{series.series_id}", f"{repo}:{version}-{MOVING_TAG}"]


def default_tag(pin: Pin, series: Series, mode: SeriesMode = "apply") -> str:
    """`vllm-moriio-overlay:v<vLLM version>-<series id>` (`-base` without
    the series)."""
    return image_tags(None, pin, series, mode)[0]


def _capture(
    argv: Sequence[str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise ImageError(
            f"`{shlex.join(argv)}` did not finish in {timeout:.0f} s"
        ) from e
    except OSError as e:
        raise ImageError(f"`{argv[0]}`: {e}") from e


def _stream(argv: Sequence[str], say: Say) -> int:
    say(f"$ {shlex.join(argv)}")
    try:
        return subprocess.run(list(argv), check=False).returncode
    except OSError as e:
        raise ImageError(f"`{argv[0]}`: {e}") from e


def _repo_of(line: str) -> str:
    try:
        return parse_reference(line).qualified().name
    except ImageReferenceError:
        return ""


def resolve_base(engine: Engine, base: ImageReference, say: Say) -> ImageReference:
    """Make the base present (pulled as its own step) and learn its digest."""
    pull_ref = base.by_digest() if base.digest else str(base)
    if _capture(engine.exists(pull_ref)).returncode == 0:
        say(f"base: {pull_ref} is present")
    else:
        say(f"base: pulling {pull_ref}")
        start = time.monotonic()
        if _stream(engine.pull(pull_ref), say) != 0:
            raise ImageError(
                f"cannot pull the base {pull_ref} with {engine.name} (a registry "
                "that needs a login: log in first; a local base: build it first, "
                "e.g. `nox -s image-standin`)"
            )
        say(f"base: pulled in {time.monotonic() - start:.1f} s")
    if base.digest:
        return base
    out = _capture(engine.digest(pull_ref))
    digest = ""
    if out.returncode == 0:
        for line in out.stdout.split():
            if engine.name == "docker" and _repo_of(line) != base.name:
                continue  # another name's digest (docker lists one per repo)
            digest = line.rpartition("@")[2]
            break
    if digest.startswith("sha256:"):
        say(f"base: digest {digest}")
        return base.with_digest(digest)
    say(
        f"base: no manifest digest for {pull_ref} (never pushed); labelled by name only"
    )
    return base


def run_verify(
    engine: Engine, tag: str, mode: SeriesMode = "apply", rdma: bool = True
) -> Verification:
    """`vllm-overlay image verify --json` in a throwaway container of ``tag``."""
    steps = engine.run(tag, verify_command(mode, rdma))
    if engine.is_buildah:  # from, run, rm
        made = _capture(steps[0])
        if made.returncode != 0 or not made.stdout.split():
            raise ImageError(f"`{shlex.join(steps[0])}` failed: {made.stderr.strip()}")
        container = made.stdout.split()[-1]

        def fill(argv: list[str]) -> list[str]:
            return [a.replace("{container}", container) for a in argv]

        try:
            result = _capture(fill(steps[1]), timeout=1800)
        finally:
            _capture(fill(steps[2]))
    else:
        result = _capture(steps[0], timeout=1800)
    try:
        return msgspec.json.decode(result.stdout, type=Verification)
    except (msgspec.DecodeError, msgspec.ValidationError):
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise ImageError(
            f"`vllm-overlay image verify` in {tag} gave no verdict (exit status "
            f"{result.returncode}):\n{tail}"
        ) from None


def read_labels(engine: Engine, tag: str) -> dict[str, str]:
    out = _capture(engine.labels(tag))
    if out.returncode != 0:
        raise ImageError(f"cannot read the labels of {tag}: {out.stderr.strip()}")
    return engine.parse_labels(out.stdout)


def read_size(engine: Engine, tag: str) -> str:
    out = _capture(engine.size(tag))
    text = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    if text.isdigit():
        return f"{int(text) / 1e9:.2f} GB"
    return text or "unknown"


def record_digest(repo: Path, pin: Pin, digest: str) -> None:
    """Write the base's digest into pin.toml."""
    image = ImageRef(pin.image.reference, digest)
    new = msgspec.structs.replace(pin, image=image)
    (repo / PIN_FILE).write_text(encode_pin(new))


def dry_run(
    choice: Choice,
    tags: list[str],
    base: ImageReference,
    args: dict[str, str],
    repo: Path,
    push: bool,
    verify: bool,
    say: Say,
    mode: SeriesMode = "apply",
    rdma: bool = True,
) -> None:
    engine = choice.engine or Engine("docker", "docker")
    tag = tags[0]
    names = ", ".join(tags)
    what = (
        f"series {args['SERIES_ID']}"
        if mode == "apply"
        else "no series: the banner plugin and the base's MoRIIO files, the A/B base"
    )
    say(f"# image {names} from {args['BASE_IMAGE']} ({what})")
    say(f"# engine: {choice.explain()}")
    if choice.engine is None:
        say("# no engine can build here; the commands are shown for docker")
    say("# build args:")
    for key, value in args.items():
        say(f"#   {key}={value}")
    pull_ref = base.by_digest() if base.digest else str(base)
    say(f"# the base, unless present:\n{shlex.join(engine.pull(pull_ref))}")
    build = engine.build(
        str(repo / DOCKERFILE),
        tags,
        args,
        str(repo),
        build_secrets(),
        build_labels(args),
    )
    say(shlex.join(build))
    say(shlex.join(engine.labels(tag)))
    if verify:
        for argv in engine.run(tag, verify_command(mode, rdma)):
            say(shlex.join(argv))
    if push:
        for each in tags:
            say(shlex.join(engine.push(each)))


def build_image(
    repo: Path,
    *,
    tag: str | None = None,
    base: str | None = None,
    push: bool = False,
    dry: bool = False,
    engine: str | None = None,
    verify: bool = True,
    record: bool = False,
    report_path: Path | None = None,
    which: Which | None = None,
    probe: Probe = _probe_info,
    say: Say = print,
    mode: SeriesMode = "apply",
    rdma: bool = True,
) -> ImageReport | None:
    """Build (and check, and push) the image; None for a dry run. Raises
    ImageError when a step fails, after printing what it found."""
    pin = load_pin(repo / PIN_FILE)
    series = load_series(repo)
    tags = image_tags(tag, pin, series, mode)
    tag = tags[0]
    base_ref = base_reference(pin, base)
    choice = choose_engine(engine, which or shutil.which, probe)
    if dry:
        args = build_args(repo, pin, series, base_ref, mode)
        dry_run(choice, tags, base_ref, args, repo, push, verify, say, mode, rdma)
        return None
    if choice.engine is None:
        raise ImageError(
            f"no container engine can build here: {choice.explain()} (install "
            "docker, podman or buildah, or use --dry-run)"
        )
    eng = choice.engine
    say(f"engine: {eng.describe()} ({choice.explain()})")
    base_ref = resolve_base(eng, base_ref, say)
    args = build_args(repo, pin, series, base_ref, mode)
    start = time.monotonic()
    secrets = build_secrets()
    if secrets:
        say(f"build: pip trusts {secrets['pip-cert']} (secret pip-cert, in no layer)")
    argv = eng.build(
        str(repo / DOCKERFILE), tags, args, str(repo), secrets, build_labels(args)
    )
    status = _stream(argv, say)
    seconds = time.monotonic() - start
    if status != 0:
        raise ImageError(
            f"`{eng.name} {'bud' if eng.is_buildah else 'build'}` failed for {tag} "
            f"after {seconds:.1f} s (the failing step is above)"
        )
    say(f"build: {', '.join(tags)} in {seconds:.1f} s")
    labels = read_labels(eng, tag)
    problems = label_problems(labels, args)
    for label, arg in LABELS.items():
        mark = "ok " if labels.get(label) == args[arg] else "FAIL"
        say(f"  {mark}  label {label}={labels.get(label, '(missing)')}")
    verification = None
    if verify:
        check = verify_command(mode, rdma)
        say(f"verify: `{shlex.join(check)}` in a container of {tag}")
        verification = run_verify(eng, tag, mode, rdma)
        say(format_verification(verification))
    size = read_size(eng, tag)
    report = ImageReport(
        tag=tag,
        tags=tags,
        engine=eng.name,
        base_name=args["BASE_NAME"],
        base_digest=base_ref.digest,
        build_seconds=round(seconds, 1),
        size=size,
        labels=labels,
        label_problems=problems,
        verification=verification,
        pushed=False,
    )
    if report.ok and push:
        for each in tags:
            if _stream(eng.push(each), say) != 0:
                raise ImageError(f"`{eng.name} push` failed for {each}")
        report.pushed = True
    if record and base is None and base_ref.digest and not pin.image.digest:
        record_digest(repo, pin, base_ref.digest)
        say(f"pin.toml: [image] digest = {base_ref.digest!r}")
    elif base is None and base_ref.digest and not pin.image.digest:
        say(f"pin.toml records no digest; --record-digest writes {base_ref.digest}")
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_bytes(
            msgspec.json.format(msgspec.json.encode(report)) + b"\n"
        )
    checks = (
        f"{sum(c.ok for c in verification.checks)}/{len(verification.checks)} checks"
        if verification
        else "not verified"
    )
    verdict = "ok" if report.ok else "FAILED"
    say(
        f"image: {verdict}, {tag} ({size}) from {args['BASE_NAME']}"
        f"{'@' + base_ref.digest if base_ref.digest else ''} in {seconds:.1f} s; "
        f"{checks}, {len(LABELS) - len(problems)}/{len(LABELS)} labels"
        f"{'; pushed' if report.pushed else ''}"
    )
    if not report.ok:
        raise ImageError(f"{tag} was built but fails its checks (see above)")
    return report
