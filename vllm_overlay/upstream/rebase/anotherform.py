"""A patch that landed upstream in another form: the rule and its evidence.

A patch that neither applies nor landed hunk for hunk may still be upstream:
vLLM merged the pull request it carries, in a form that differs from ours
(renamed helpers, restructured code, some of our lines and not others).
Each hunk of such a patch has a state (``report.HunkState``, set by
``classify``):

- ``landed``: the new base holds it (``landed.HunkCheck.landed``: its
  post-image verbatim, or its evidence lines in place);
- ``changed upstream``: upstream rewrote the very lines it changes (every
  evidence line it removes is gone) and something of ours is there (some
  of its evidence lines near where it sits, or some of the new names it
  adds anywhere in the new base: ``HunkCheck.in_another_form``);
- ``still to carry``: it applies to the new base on its own;
- ``conflicting``: none of these (upstream rewrote its lines with nothing
  of ours in them, or its lines are partly still there).

The rule (constraints, stated in docs/upstream.md too): the patch *landed
in another form* when

1. at least ``MIN_LANDED`` of its hunks landed outright, and
2. more of its hunks show upstream's change (``landed`` plus ``changed
   upstream``) than conflict (``conflicting``): strictly more, so one hunk
   that landed next to one that conflicts is still a conflict.

A genuine conflict (upstream rewrote the same lines with nothing of ours in
them) has no hunk that landed and no hunk changed upstream with ours
there: it stays a ``conflict``. Such a patch is reported ``partly
upstream``; it cannot be refreshed mechanically (what is left to carry is a
person's call), so the series does not move until a hand-refreshed
remainder is given (``--refreshed``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from vllm_overlay.series.patch_series import PatchHeader
from vllm_overlay.upstream.rebase.report import HunkState

# At least this many hunks landed outright (rule 1).
MIN_LANDED = 1
# The states that show upstream's change (rule 2), in the order the
# evidence names them.
SHOWING: tuple[HunkState, ...] = ("landed", "changed upstream")
ORDER: tuple[HunkState, ...] = (
    "landed",
    "changed upstream",
    "still to carry",
    "conflicting",
)
PROCEDURE = 'docs/upstream.md, "re-basing by hand"'
_PULL_RE = re.compile(r"/pull/(\d+)(?:[/#?].*)?$")


def landed_in_another_form(states: Iterable[HunkState]) -> bool:
    """Rules 1 and 2 over every hunk of a patch."""
    listed = list(states)
    landed = listed.count("landed")
    showing = sum(listed.count(s) for s in SHOWING)
    return landed >= MIN_LANDED and showing > listed.count("conflicting")


def evidence(per_file: Mapping[str, Mapping[int, HunkState]]) -> str:
    """``moriio_connector.py: #1 #7 landed; #9 changed upstream; ...``, one
    part per file (0-based hunk indexes in, 1-based numbers out)."""
    parts = []
    for name, states in per_file.items():
        groups = [
            " ".join(f"#{k + 1}" for k in sorted(states) if states[k] == state)
            + f" {state}"
            for state in ORDER
            if state in states.values()
        ]
        parts.append(f"{name}: " + "; ".join(groups))
    return "; ".join(parts)


def upstream_change(header: PatchHeader) -> str:
    """The upstream pull request the header names (Forwarded, Origin, Bug):
    ``#60867 (https://...)``; another URL as it is; "" for none."""
    urls = [
        u
        for u in (header.forwarded_url, header.origin_url, header.bug.strip())
        if u.startswith(("http://", "https://"))
    ]
    for url in urls:
        m = _PULL_RE.search(url)
        if m:
            return f"#{m.group(1)} ({url})"
    return urls[0] if urls else ""


def hand_line(name: str, version: str) -> str:
    """What to do with a patch landed in another form, in one line."""
    return (
        f"{name} cannot be refreshed mechanically: refresh its remainder by "
        f"hand ({PROCEDURE}), set Applied-Upstream: {version} (in part), and "
        f"run again with --refreshed PATH/{name}"
    )
