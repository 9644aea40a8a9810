"""A stand-in container engine for the build driver's tests: one script
answers as docker, podman or buildah (by its own name), records every call
in ``<name>.calls`` (JSON lines) and keeps what a build recorded in
``<name>.state``. It labels an image the way docker/Dockerfile's LABEL
instruction says, substituting the build args, as a real engine does.

Behaviour knobs (environment of the test process, read at call time):
FAKE_INFO=fail, FAKE_BASE=absent|present, FAKE_PULL=fail, FAKE_BUILD=fail,
FAKE_VERIFY=ok|fail|garbage, FAKE_DIGEST=<text printed by the digest query>.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

from tests.repo import REPO

SCRIPT = """#!{python}
import sys
sys.path.insert(0, {repo!r})
from tests.image.fake_engine import main
sys.exit(main(sys.argv))
"""


def install(bin_dir: Path, name: str) -> Path:
    """Put a fake ``name`` in ``bin_dir``; returns its call log."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(SCRIPT.format(python=sys.executable, repo=str(REPO)))
    script.chmod(0o755)
    return bin_dir / f"{name}.calls"


def calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def dockerfile_labels(args: dict[str, str]) -> dict[str, str]:
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    label = next(
        line.strip()[len("LABEL ") :]
        for line in text.splitlines()
        if line.strip().startswith("LABEL ")
    )
    out = {}
    for item in shlex.split(label):
        key, _, value = item.partition("=")
        out[key] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), value)
    return out


def _verification(ok: bool) -> dict[str, object]:
    return {
        "python": "/usr/bin/python3 3.12.0",
        "vllm_dir": "/usr/local/lib/python3.12/dist-packages/vllm",
        "series_id": "fake",
        "checks": [
            {"name": "overlay", "ok": True, "detail": "overlaid"},
            {"name": "connector-import", "ok": ok, "detail": "fake"},
        ],
    }


def main(argv: list[str]) -> int:
    me = Path(argv[0])
    name, args = me.name, argv[1:]
    with (me.parent / f"{name}.calls").open("a") as f:
        f.write(json.dumps(args) + "\n")
    state_file = me.parent / f"{name}.state"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    env = os.environ.get
    verb = args[0]
    if verb == "info":
        if env("FAKE_INFO") == "fail":
            print(f"Cannot connect to the {name} daemon", file=sys.stderr)
            return 1
        return 0
    if verb in ("build", "bud"):
        if env("FAKE_BUILD") == "fail":
            print("STEP 7/12: RUN ... exit status 1", file=sys.stderr)
            return 1
        build_args = dict(
            args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--build-arg"
        )
        tag = args[args.index("--tag") + 1]
        state[tag] = dockerfile_labels(build_args)
        state_file.write_text(json.dumps(state))
        return 0
    fmt = args[args.index("--format") + 1] if "--format" in args else ""
    ref = args[-1]
    if name == "buildah" and verb == "inspect" and not fmt:  # labels, as JSON
        print(json.dumps({"OCIv1": {"config": {"Labels": state.get(ref)}}}))
        return 0 if ref in state else 1
    if "Labels" in fmt:
        print(json.dumps(state.get(ref)))
        return 0 if ref in state else 1
    if "Digest" in fmt:
        print(env("FAKE_DIGEST", ""))
        return 0
    if "Size" in fmt:
        print("2520000000" if name != "buildah" else "2.52 GB")
        return 0
    if verb in ("inspect", "image"):  # does the base exist?
        if ref in state or env("FAKE_BASE", "present") == "present":
            print("sha256:" + "1" * 64)
            return 0
        print(f"Error: {ref}: image not known", file=sys.stderr)
        return 1
    if verb == "pull":
        return 1 if env("FAKE_PULL") == "fail" else 0
    if verb == "from":
        print("fake-container-1")
        return 0
    if verb == "run":
        mode = env("FAKE_VERIFY", "ok")
        if mode == "garbage":
            print("Traceback (most recent call last):\nImportError: no vllm_overlay")
            return 1
        print(json.dumps(_verification(mode == "ok")))
        return 0 if mode == "ok" else 1
    if verb in ("rm", "push"):
        return 0
    print(f"fake {name}: unexpected {args}", file=sys.stderr)
    return 2
