"""A stand-in for the `docker` CLI, enough for the harness: run (detached or
in the foreground), inspect, logs, rm --force, pull, image inspect.

"Containers" are local processes. The image's entry points map to stand-ins:
`vllm serve ...` -> tests/e2e/standin.py, `vllm-router` -> the real router of
this environment, `python3 .../moriio_toy_proxy_server.py` ->
tests/e2e/frontend.py. State lives in $FAKE_DOCKER_STATE. Behaviour knobs:
- FAKE_DOCKER_DIE: comma list; a container whose name contains one prints a
  start-up failure and exits with 3 (a MoRI assert, an OOM ...);
- FAKE_DOCKER_LOADING: comma list; such a container runs but never serves
  (a server still loading its weights);
- FAKE_DOCKER_PULL: ok (default, prints progress), hang, fail;
- FAKE_DOCKER_HAVE_IMAGE=1: `image inspect` finds the image.
Labels (`--label`) are kept per container; `ps --all --filter label=K=V
--format {{.Names}}` lists the containers that carry every label asked.
Every call's argv is appended to calls.jsonl in the state directory (what
`ps` shows on a node); every container's env, as sha256 per name, to
env/<name>.json (what reached the container, and no value).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VALUE_FLAGS = {
    "--name", "--network", "--ipc", "--device", "--group-add", "--cap-add",
    "--security-opt", "--ulimit", "--shm-size", "--volume", "-v", "--env", "-e",
    "--entrypoint", "--user", "--format", "--tail", "--env-file", "--label", "--mount",
    "--filter",
}  # fmt: skip
SUFFIXES = (".json", ".exit", ".cmd", ".log", ".labels")
DIE_LINES = (
    "INFO 11-30 12:00:00 api_server.py:1] vLLM API server version 0.33.0",
    "INFO 11-30 12:00:05 core.py:1] Initializing MoRIIO worker",
    "ERROR 11-30 12:00:09 core.py:2] RuntimeError: MoRI: RdmaContext::Initialize: "
    "no RDMA device matches MORI_RDMA_DEVICES",
    "ERROR 11-30 12:00:09 core.py:3] EngineCore failed to start.",
)


def state() -> Path:
    d = Path(os.environ["FAKE_DOCKER_STATE"])
    d.mkdir(parents=True, exist_ok=True)
    return d


def parse(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Flags (with values) and the positional arguments after them."""
    flags: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        if flag in VALUE_FLAGS:
            flags.setdefault(flag, []).append(args[i + 1])
            i += 2
        else:
            flags.setdefault(flag, []).append("")
            i += 1
    return flags, args[i:]


def command_for(name: str, entrypoint: str, args: list[str]) -> list[str]:
    die = [d for d in os.environ.get("FAKE_DOCKER_DIE", "").split(",") if d]
    if any(d in name for d in die):
        text = "\n".join(DIE_LINES)
        return [
            sys.executable,
            "-c",
            f"print({text!r}, flush=True); raise SystemExit(3)",
        ]
    loading = [d for d in os.environ.get("FAKE_DOCKER_LOADING", "").split(",") if d]
    if any(d in name for d in loading):
        # Still loading its weights: runs, never serves (the health wait
        # goes on until a timeout or an interruption).
        script = "import time; print('Loading weights', flush=True); time.sleep(3600)"
        return [sys.executable, "-c", script]
    if entrypoint == "sh" and args[:1] == ["-c"] and args[3:5] == ["bench", "serve"]:
        # The load phase: `vllm bench serve ...` whose saved result the
        # container prints.
        return [sys.executable, str(HERE / "fakebench.py"), *args[3:]]
    if entrypoint == "vllm":
        return [sys.executable, str(HERE / "standin.py"), *args]
    if entrypoint == "vllm-router":
        return [str(Path(sys.executable).parent / "vllm-router"), *args]
    if (
        entrypoint == "python3"
        and args
        and args[0].endswith("moriio_toy_proxy_server.py")
    ):
        return [sys.executable, str(HERE / "frontend.py"), *args[1:]]
    raise SystemExit(f"fake docker: no stand-in for entrypoint {entrypoint} {args[:1]}")


def given_env(flags: dict[str, list[str]]) -> dict[str, str]:
    """What docker sets in the container: --env-file lines, then --env; a
    name without a value takes the client's own (unset: left out)."""
    env: dict[str, str] = {}
    entries = []
    for path in flags.get("--env-file", []):
        lines = Path(path).read_text().splitlines()
        entries += [x for x in lines if x.strip() and not x.startswith("#")]
    entries += flags.get("--env", []) + flags.get("-e", [])
    for kv in entries:
        key, eq, value = kv.partition("=")
        if eq:
            env[key] = value
        elif key in os.environ:
            env[key] = os.environ[key]
    return env


def child_env(name: str, flags: dict[str, list[str]], image: str) -> dict[str, str]:
    given = given_env(flags)
    record = state() / "env"
    record.mkdir(exist_ok=True)
    digests = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in given.items()}
    (record / f"{name}.json").write_text(json.dumps(digests))
    env = {**os.environ, **given}
    env["PYTHONPATH"] = str(REPO)
    env["STANDIN_IMAGE"] = image
    return env


def supervise(name: str, argv: list[str], env: dict[str, str], log: Path | None) -> int:
    """Run the container's process in a process group of its own (what
    `rm --force` kills); forward SIGTERM/SIGINT; record its exit."""
    out = log.open("ab") if log is not None else None
    # Detached: both streams into the log; in the foreground, stdout and
    # stderr stay apart, as `docker run` without a tty keeps them.
    err = subprocess.STDOUT if out is not None else None
    child = subprocess.Popen(
        argv, env=env, stdout=out, stderr=err, start_new_session=True
    )
    info = state() / f"{name}.json"
    info.write_text(json.dumps({"pid": os.getpid(), "group": child.pid}))

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    (state() / f"{name}.exit").write_text(str(code))
    return code


def cmd_run(args: list[str]) -> int:
    flags, rest = parse(args)
    entrypoint = flags["--entrypoint"][0]
    if entrypoint == "chown":  # the cache directory handed to the image's user
        return 0
    name = flags["--name"][0]
    image, inner = rest[0], rest[1:]
    for mount in flags.get("--mount", []):
        spec = dict(x.partition("=")[::2] for x in mount.split(","))
        if not Path(spec.get("source", "")).exists():
            print(
                "docker: Error response from daemon: invalid mount config for type "
                f'"bind": bind source path does not exist: {spec.get("source")}',
                file=sys.stderr,
            )
            return 125
    assert image, "no image"
    if (state() / f"{name}.json").exists():
        print(
            f"docker: Error: the container name {name} is already in use",
            file=sys.stderr,
        )
        return 125
    argv = command_for(name, entrypoint, inner)
    labels = dict(x.partition("=")[::2] for x in flags.get("--label", []))
    (state() / f"{name}.labels").write_text(json.dumps(labels))
    env = child_env(name, flags, image)
    log = state() / f"{name}.log"
    log.write_bytes(b"")
    (state() / f"{name}.exit").unlink(missing_ok=True)
    if "--detach" in flags:
        spec = state() / f"{name}.cmd"
        spec.write_text(json.dumps({"argv": argv, "env": env}))
        sup = subprocess.Popen(
            [sys.executable, "-S", __file__, "_supervise", name],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        # The supervisor records itself and the container's process group.
        deadline = time.monotonic() + 30
        while not (state() / f"{name}.json").exists():
            if sup.poll() is not None or time.monotonic() > deadline:
                print(f"docker: {name} did not start", file=sys.stderr)
                return 125
            time.sleep(0.05)
        print(f"fake{sup.pid:012d}")
        return 0
    (state() / f"{name}.json").write_text(json.dumps({"pid": os.getpid()}))
    try:
        return supervise(name, argv, env, None)
    finally:
        if "--rm" in flags:
            for suffix in SUFFIXES:
                (state() / f"{name}{suffix}").unlink(missing_ok=True)


def cmd_supervise(name: str) -> int:
    spec = json.loads((state() / f"{name}.cmd").read_text())
    return supervise(name, spec["argv"], spec["env"], state() / f"{name}.log")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs. A supervisor whose `docker run` exited is
    reparented to init, which may reap it seconds after it died: a zombie
    is dead (docker's `rm` returns once the container is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which may hold spaces.
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def lookup(
    args: list[str], kind: str
) -> tuple[dict[str, list[str]], str, dict[str, Any] | None]:
    """A command's flags, the container it names and that container's record,
    or None after docker's error for no such ``kind`` (object, container)."""
    flags, rest = parse(args)
    name = rest[0]
    info = state() / f"{name}.json"
    if not info.exists():
        print(f"Error: No such {kind}: {name}", file=sys.stderr)
        return flags, name, None
    return flags, name, json.loads(info.read_text())


def cmd_inspect(args: list[str]) -> int:
    flags, name, record = lookup(args, "object")
    if record is None:
        return 1
    exit_file = state() / f"{name}.exit"
    if exit_file.exists():
        print(f"exited {exit_file.read_text().strip()} false")
    elif alive(record["pid"]):
        print("running 0 false")
    else:
        print("dead 137 false")
    return 0


def cmd_logs(args: list[str]) -> int:
    flags, name, record = lookup(args, "container")
    if record is None:
        return 1
    log = state() / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if "--tail" in flags:
        lines = lines[-int(flags["--tail"][0]) :]
    print("\n".join(lines))
    return 0


def cmd_rm(args: list[str]) -> int:
    flags, name, record = lookup(args, "container")
    if record is None:
        return 1
    # Like docker: SIGKILL, at once, to everything in the container.
    group = record.get("group")
    if group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    pid = record["pid"]
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for suffix in SUFFIXES:
        (state() / f"{name}{suffix}").unlink(missing_ok=True)
    print(name)
    return 0


def cmd_ps(args: list[str]) -> int:
    flags, _ = parse(args)
    assert "--all" in flags and flags.get("--format") == ["{{.Names}}"], args
    filters = flags.get("--filter", [])
    assert all(f.startswith("label=") for f in filters), filters
    wanted = [f.removeprefix("label=") for f in filters]
    for info in sorted(state().glob("*.json")):
        labels_file = info.with_suffix(".labels")
        labels = json.loads(labels_file.read_text()) if labels_file.exists() else {}
        pairs = {f"{k}={v}" for k, v in labels.items()}
        if all(w in pairs for w in wanted):
            print(info.stem)
    return 0


def cmd_pull(args: list[str]) -> int:
    mode = os.environ.get("FAKE_DOCKER_PULL", "ok")
    image = args[-1]
    print(
        f"{image.rsplit(':', 1)[-1]}: Pulling from {image.rsplit(':', 1)[0]}",
        flush=True,
    )
    if mode == "fail":
        print(f"Error response from daemon: manifest for {image} not found", flush=True)
        return 1
    for layer in ("3f1a0c2e", "9b2d4e61"):
        print(f"{layer}: Pulling fs layer", flush=True)
        if mode == "hang":
            time.sleep(3600)
        print(f"{layer}: Pull complete", flush=True)
    print(f"Status: Downloaded newer image for {image}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd != "_supervise":
        with (state() / "calls.jsonl").open("a") as f:
            f.write(json.dumps(["docker", *argv]) + "\n")
    if cmd == "_supervise":
        return cmd_supervise(args[0])
    if cmd == "image" and args[:1] == ["inspect"]:
        return 0 if os.environ.get("FAKE_DOCKER_HAVE_IMAGE") == "1" else 1
    handlers = {
        "run": cmd_run, "inspect": cmd_inspect, "logs": cmd_logs, "rm": cmd_rm,
        "pull": cmd_pull, "ps": cmd_ps,
    }  # fmt: skip
    if cmd not in handlers:
        print(f"fake docker: unknown command {cmd}", file=sys.stderr)
        return 2
    return handlers[cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
