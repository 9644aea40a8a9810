"""Whether the pinned base's MoRIIO connector starts, per simulator layout.

The start-up refusals of the base (``expect.refusals``) are not typed per
vLLM version: they follow what the CPU simulator (``vllm-overlay simulate``:
the real connector of the pinned vLLM, without the series) says when it
starts a layout that has the mechanism. That verdict needs vLLM and takes a
minute, and the dry run runs without vLLM, so it is recorded here and
``tests/e2e/test_expect.py::test_refusals_agree_with_the_simulator`` runs the
simulator on the pinned base and fails, printing the record to put here,
whenever this one differs (a new pin, a patch moving upstream).
"""

from __future__ import annotations

import msgspec


class BaseStarts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The simulator's start-up verdicts on the pinned base."""

    vllm: str  # the pinned vLLM version the simulator ran
    # simulator layout -> the base connector's refusal at start ("": starts)
    refused: dict[str, str]

    def refusal(self, layout: str) -> str:
        return self.refused.get(layout, "")


# The simulator's GLM layout (MLA + indexer, a kpool tail ring, KDA state
# groups, MTP-like slots): two attention groups, a ring, a drafter beside KDA.
HYBRID_PROBE = "glm"

RECORDED = BaseStarts(vllm="0.34.0", refused={HYBRID_PROBE: ""})
