"""Make and check `git format-patch` mails with git itself, in scratch repos.

A mail is made by committing the "before" files of the change (the pinned
vLLM files) and then the "after" files in a throwaway repository, with fixed
identities and dates, and running ``git format-patch``: the result is
byte-for-byte reproducible, and its ``index`` lines name the real vLLM blobs.
It is checked by ``git am --keep-non-patch`` onto the "before" files in a
second repository (``--keep-non-patch`` keeps vLLM's ``[Tag]`` subject
prefixes, which plain ``git am`` strips).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError

BASE_IDENTITY = ("vLLM base", "base@vllm.invalid")
BASE_DATE = "2000-01-01T00:00:00+00:00"


class GitMailError(OverlayError):
    """git failed while making or checking a mail."""


@dataclass(frozen=True)
class Identity:
    name: str
    email: str

    @classmethod
    def parse(cls, author: str) -> Identity:
        """``Name <email>`` as given, else a GitHub handle with its
        noreply address (``handle <handle@users.noreply.github.com>``)."""
        m = re.fullmatch(r"\s*(.+?)\s*<([^<>@\s]+@[^<>\s]+)>\s*", author)
        if m:
            return cls(m.group(1), m.group(2))
        handle = author.strip().removeprefix("@")
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?", handle):
            raise GitMailError(
                f"Author {author!r} is neither 'Name <email>' nor a GitHub handle"
            )
        return cls(handle, f"{handle}@users.noreply.github.com")

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"


def _git(repo: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(repo),  # no user configuration (signoff, hooks, ...)
        "GIT_CONFIG_NOSYSTEM": "1",
        "LC_ALL": "C",
        "TZ": "UTC",
        **(env or {}),
    }
    run = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=full_env
    )
    if run.returncode != 0:
        raise GitMailError(
            f"git {args[0]} failed: {(run.stderr or run.stdout).strip()}"
        )
    return run.stdout


def _identity_env(
    who: Identity, date: str, committer: Identity | None = None
) -> dict[str, str]:
    committer = committer or who
    return {
        "GIT_AUTHOR_NAME": who.name,
        "GIT_AUTHOR_EMAIL": who.email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": committer.name,
        "GIT_COMMITTER_EMAIL": committer.email,
        "GIT_COMMITTER_DATE": date,
    }


def user_identity(cwd: Path) -> Identity | None:
    """Who is exporting: ``GIT_COMMITTER_NAME``/``EMAIL``, else git's
    ``user.name``/``user.email`` as seen from ``cwd`` (the identity
    ``git commit -s`` signs off with); None when either is unset."""
    values = []
    for var, key in (
        ("GIT_COMMITTER_NAME", "user.name"),
        ("GIT_COMMITTER_EMAIL", "user.email"),
    ):
        value = os.environ.get(var, "")
        if not value:
            run = subprocess.run(
                ["git", "-C", str(cwd), "config", "--get", key],
                capture_output=True,
                text=True,
            )
            value = run.stdout.strip() if run.returncode == 0 else ""
        values.append(value)
    name, email = values
    return Identity(name, email) if name and email else None


def _write(repo: Path, files: Mapping[str, str]) -> None:
    for path, text in files.items():
        dest = repo / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "w", newline="") as f:
            f.write(text)


def _init_with_base(repo: Path, before: Mapping[str, str]) -> None:
    # No template: the sample hooks are a dozen files per throwaway repository.
    _git(repo, "init", "-q", "--template=", "-b", "main")
    _write(repo, before)
    _git(repo, "add", "-A")
    base_env = _identity_env(Identity(*BASE_IDENTITY), BASE_DATE)
    _git(repo, "commit", "-q", "--allow-empty", "-m", "base", env=base_env)


def format_patch(
    before: Mapping[str, str],
    after: Mapping[str, str],
    author: Identity,
    date: str,
    message: str,
    signoff: Identity | None = None,
) -> str:
    """The ``git format-patch`` mail turning ``before`` into ``after``
    (paths -> texts; a path only in ``after`` is a new file); with
    ``signoff``, committed by them with ``git commit -s`` (their
    ``Signed-off-by`` trailer, as vLLM's DCO check wants)."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-mail-") as tmp:
        repo = Path(tmp)
        _init_with_base(repo, before)
        _write(repo, after)
        _git(repo, "add", "-A")
        msg = repo / ".git" / "OVERLAY_MSG"
        msg.write_text(message)
        _git(
            repo,
            "commit",
            "-q",
            "--cleanup=verbatim",
            *(["--signoff"] if signoff else []),
            "-F",
            str(msg),
            env=_identity_env(author, date, signoff),
        )
        return _git(repo, "format-patch", "-1", "--stdout", "--no-signature")


@dataclass(frozen=True)
class AmResult:
    subject: str
    author: str
    signoffs: list[str]  # the Signed-off-by trailers, in order
    files: dict[str, str]


def am_check(before: Mapping[str, str], mail: str, paths: list[str]) -> AmResult:
    """Apply ``mail`` with ``git am --keep-non-patch`` onto ``before``;
    return the commit's subject, author and the texts of ``paths``."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-am-") as tmp:
        repo = Path(tmp)
        _init_with_base(repo, before)
        mbox = repo / ".git" / "OVERLAY_MAIL"
        mbox.write_text(mail)
        env = _identity_env(Identity(*BASE_IDENTITY), BASE_DATE)
        _git(repo, "am", "-q", "--keep-non-patch", str(mbox), env=env)
        subject = _git(repo, "log", "-1", "--format=%s").rstrip("\n")
        author = _git(repo, "log", "-1", "--format=%an <%ae>").rstrip("\n")
        trailers = "--format=%(trailers:key=Signed-off-by,valueonly)"
        signoffs = _git(repo, "log", "-1", trailers).split("\n")
        files = {}
        for path in paths:
            with open(repo / path, newline="") as f:
                files[path] = f.read()
        return AmResult(subject, author, [s for s in signoffs if s], files)


def am_series(
    before: Mapping[str, str], mails: list[str], paths: list[str]
) -> dict[str, str]:
    """Apply ``mails`` in order with ``git am --keep-non-patch`` onto
    ``before`` (one ``git am`` for all of them); return the texts of
    ``paths`` afterwards. A mail that does not apply is named by its place."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-am-series-") as tmp:
        repo = Path(tmp)
        _init_with_base(repo, before)
        env = _identity_env(Identity(*BASE_IDENTITY), BASE_DATE)
        boxes = []
        for i, mail in enumerate(mails, 1):
            mbox = repo / ".git" / f"OVERLAY_MAIL_{i}"
            mbox.write_text(mail)
            boxes.append(str(mbox))
        try:
            _git(repo, "am", "-q", "--keep-non-patch", *boxes, env=env)
        except GitMailError as e:
            applied = int(_git(repo, "rev-list", "--count", "HEAD")) - 1
            raise GitMailError(f"mail {applied + 1} of {len(mails)}: {e}") from None
        files = {}
        for path in paths:
            with open(repo / path, newline="") as f:
                files[path] = f.read()
        return files
