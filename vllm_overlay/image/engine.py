"""Container engines: which one can build here, and the exact command lines
each one takes for the steps of an image build.

docker, podman and buildah are tried in that order; the first that is
installed and answers `ENGINE info` builds. A docker client without a daemon
(`docker info` fails) is passed over with the reason it gave. buildah runs
RUN steps with the OCI runtime when one is installed (runc or crun), else
with `--isolation chroot` (what works as root in a container or a sandbox);
`BUILDAH_ISOLATION` overrides both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ENGINES = ("docker", "podman", "buildah")

Which = Callable[[str], str | None]
# (ok, reason): can this engine build here, and if not, why.
Probe = Callable[[str], tuple[bool, str]]


def probe_info(path: str) -> tuple[bool, str]:
    """Run `ENGINE info`: works, or the last line it said."""
    try:
        out = subprocess.run(
            [path, "info"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    if out.returncode == 0:
        return True, ""
    for stream in (out.stderr, out.stdout):  # docker: the error on stderr
        said = [line.strip() for line in stream.splitlines() if line.strip()]
        if said:
            return False, said[-1]
    return False, f"exit status {out.returncode}"


@dataclass(frozen=True)
class Engine:
    name: str  # docker | podman | buildah
    path: str
    isolation: str = ""  # buildah only: "chroot", "oci", or "" (its default)

    @property
    def is_buildah(self) -> bool:
        return self.name == "buildah"

    def _run_opts(self) -> list[str]:
        return [f"--isolation={self.isolation}"] if self.isolation else []

    def _inspect_image(self, fmt: str, ref: str) -> list[str]:
        """buildah's image query (its `inspect` also takes containers)."""
        return [self.path, "inspect", "--type", "image", "--format", fmt, ref]

    def exists(self, ref: str) -> list[str]:
        """Exit status 0 when ``ref`` is in local storage."""
        if self.is_buildah:
            return self._inspect_image("{{.FromImageID}}", ref)
        return [self.path, "image", "inspect", "--format", "{{.Id}}", ref]

    def pull(self, ref: str) -> list[str]:
        return [self.path, "pull", ref]

    def digest(self, ref: str) -> list[str]:
        """Prints the manifest digest of a local image (docker: its
        RepoDigests, one per line; empty for an image never pushed)."""
        if self.is_buildah:
            return self._inspect_image("{{.FromImageDigest}}", ref)
        if self.name == "podman":
            return [self.path, "image", "inspect", "--format", "{{.Digest}}", ref]
        fmt = "{{range .RepoDigests}}{{println .}}{{end}}"
        return [self.path, "image", "inspect", "--format", fmt, ref]

    def build(
        self,
        dockerfile: str,
        tags: Sequence[str],
        args: dict[str, str],
        context: str,
        secrets: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
    ) -> list[str]:
        if self.is_buildah:
            # --layers: cache every step (buildah's default is one layer);
            # the base is resolved and present before the build starts.
            # --force-rm: a failed step leaves no working container behind.
            argv = [self.path, "bud", "--layers", "--force-rm", "--pull=never"]
            argv += self._run_opts()
        elif self.name == "podman":
            argv = [self.path, "build", "--layers", "--force-rm", "--pull=never"]
        else:
            argv = [self.path, "build"]
        argv += ["--file", dockerfile]
        for tag in tags:
            argv += ["--tag", tag]
        for key, value in args.items():
            argv += ["--build-arg", f"{key}={value}"]
        for key, path in (secrets or {}).items():
            argv += ["--secret", f"id={key},src={path}"]
        for key, value in (labels or {}).items():
            argv += ["--label", f"{key}={value}"]
        return [*argv, context]

    def labels(self, ref: str) -> list[str]:
        """Prints the image's labels (read with ``parse_labels``)."""
        if self.is_buildah:  # its --format has no `json` function
            return [self.path, "inspect", "--type", "image", ref]
        fmt = "{{json .Config.Labels}}"
        return [self.path, "image", "inspect", "--format", fmt, ref]

    def parse_labels(self, output: str) -> dict[str, str]:
        value = json.loads(output or "null") or {}
        if self.is_buildah:
            value = value.get("OCIv1", {}).get("config", {}).get("Labels") or {}
        return {str(k): str(v) for k, v in value.items()}

    def size(self, ref: str) -> list[str]:
        if self.is_buildah:
            return [self.path, "images", "--format", "{{.Size}}", ref]
        return [self.path, "image", "inspect", "--format", "{{.Size}}", ref]

    def run(self, ref: str, command: Sequence[str]) -> list[list[str]]:
        """Run ``command`` in a throwaway container of ``ref``, whatever the
        image's entry point (vllm/vllm-openai-rocm's is `vllm serve`). For
        buildah: three commands, `from`, `run` and `rm`, where `{container}`
        stands for the first one's output."""
        if self.is_buildah:
            return [
                [self.path, "from", "--pull=never", "--quiet", ref],
                [self.path, "run", *self._run_opts(), "{container}", "--", *command],
                [self.path, "rm", "{container}"],
            ]
        return [
            [self.path, "run", "--rm", "--entrypoint", command[0], ref, *command[1:]]
        ]

    def push(self, ref: str) -> list[str]:
        return [self.path, "push", ref]

    def describe(self) -> str:
        text = f"{self.name} ({self.path})"
        if self.isolation:
            text += f", --isolation={self.isolation}"
        return text


def buildah_isolation(which: Which) -> tuple[str, str]:
    """The isolation buildah's RUN steps use here, and why."""
    chosen = os.environ.get("BUILDAH_ISOLATION", "")
    if chosen:
        return "", f"BUILDAH_ISOLATION={chosen}"
    runtime = which("runc") or which("crun")
    if runtime:
        return "", f"RUN steps under the OCI runtime {runtime}"
    return "chroot", "RUN steps chrooted: no OCI runtime (runc, crun) installed"


@dataclass(frozen=True)
class Choice:
    engine: Engine | None
    # One line per engine tried: why it builds, or why it was passed over.
    notes: list[str]

    def explain(self) -> str:
        return "; ".join(self.notes)


def choose_engine(
    preferred: str | None = None, which: Which = shutil.which, probe: Probe = probe_info
) -> Choice:
    """The first of ``ENGINES`` (or only ``preferred``) that is installed and
    answers `info`, with a note for every engine considered."""
    notes: list[str] = []
    for name in [preferred] if preferred else ENGINES:
        path = which(name)
        if path is None:
            notes.append(f"{name}: not installed")
            continue
        ok, why = probe(path)
        if not ok:
            notes.append(f"{name}: `{name} info` fails at {path} ({why})")
            continue
        isolation, how = ("", "")
        if name == "buildah":
            isolation, how = buildah_isolation(which)
        notes.append(f"{name}: works at {path}{f' ({how})' if how else ''}: chosen")
        return Choice(Engine(name, path, isolation), notes)
    return Choice(None, notes)
