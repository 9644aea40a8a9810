"""A byte-level case's result does not depend on the cases run before it.

One configuration's cases run in two orders and one case alone, in the
session's zygote (so the rank processes and their slot files carry over from
configuration to configuration, as in a sweep). A transfer that lands late
(after the judge, or in a later case), a buffer a rank slot keeps, or a
scheduler's prefix cache left from an earlier case would show as a case
whose result changes with its neighbours. GLM-like at a full local hit is
where a READ posted after the forward once landed in the next case's
blocks (patch 0015).
"""

from __future__ import annotations

import msgspec

from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.run import ZygoteSession

ITEM = ConfigItem("glm", "read", 1, 1, "LBNHC")
LENGTHS = (65, 100, 129)


def _per_length(r: ConfigReport) -> dict[int, bool]:
    assert r.refused_at_start is None, r.refused_at_start
    assert r.error_cases == 0, r.first_errors
    wrong = {n for ns in r.wrong_lengths.values() for n in ns}
    return {n: n in wrong for n in map(int, (r.item.lengths or "").split(","))}


def test_case_results_do_not_depend_on_order(byte_zygote: ZygoteSession) -> None:
    forward = msgspec.structs.replace(ITEM, lengths=",".join(map(str, LENGTHS)))
    backward = msgspec.structs.replace(
        ITEM, lengths=",".join(map(str, reversed(LENGTHS)))
    )
    alone = msgspec.structs.replace(ITEM, lengths=str(LENGTHS[1]))
    reports = byte_zygote.run([forward, backward, alone], forward.lengths or "", "100")
    by_item = {r.item: r for r in reports}
    one, two, three = (by_item[i] for i in (forward, backward, alone))
    assert _per_length(one) == _per_length(two)
    assert _per_length(three) == {LENGTHS[1]: _per_length(one)[LENGTHS[1]]}
    assert (one.moved_bytes, one.min_bytes) == (two.moved_bytes, two.min_bytes)
    assert one.cases == two.cases == len(LENGTHS)
    # And the overlay moves the right bytes at a full local hit.
    assert not any(_per_length(one).values()), one.wrong_notes
