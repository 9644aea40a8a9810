"""A stand-in for `ssh`: every node is this machine. It records its argv
(what `ps` shows on the harness node) in $FAKE_SSH_LOG, as JSON lines, and
runs the remote command with `sh -c` like sshd runs it with the login
shell, its stdin passed through."""

from __future__ import annotations

import json
import os
import sys

# ssh options that take a value (ssh(1)).
VALUE_OPTIONS = set("BbcDEeFIiJLlmOopQRSWw")


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_SSH_LOG"], "a") as f:
        f.write(json.dumps(["ssh", *argv]) + "\n")
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":
            i += 1
            break
        option = argv[i][1:2]
        i += 2 if option in VALUE_OPTIONS and len(argv[i]) == 2 else 1
    if i >= len(argv) - 1:
        print("fake ssh: no host or no command", file=sys.stderr)
        return 255
    command = " ".join(argv[i + 1 :])
    os.execvp("sh", ["sh", "-c", command])
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
