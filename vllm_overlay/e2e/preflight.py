"""The CPU preflight: what vLLM would build for each server, checked before
anything is launched.

``preflight_vllm.py`` works out the facts of each server with vLLM's own
parser, config classes, planner and ROCm backend classes (``LegFacts``);
this module checks them without vLLM, one line per defect:

- a KV cache group whose block size no attention backend of its layers
  supports (vLLM refuses at start: "No common block size");
- a drafter on one side only, or a different one, and any difference in the
  groups of the two legs (READ looks every local layer up in the remote
  layout: a layer the other side never allocated fails the first transfer;
  and the direct answers would come from a differently configured engine);
- a full-local-hit repeat shorter than one hashed page (it can never hit),
  a prefix-hit pair sharing less than a page;
- a failing class of the base the sweep never sends;
- a ``[layout]`` value of the config that disagrees with the layout vLLM
  builds (the layout is derived: ``derived_layout``).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from vllm_overlay.e2e.config import Layout, RunConfig
from vllm_overlay.e2e.expect import Expectations, Geometry, sweep_lengths
from vllm_overlay.errors import OverlayError


class PreflightError(OverlayError):
    """The preflight could not run (no vLLM here, no model config.json)."""


class GroupFacts(msgspec.Struct, forbid_unknown_fields=True):
    """One KV cache group of one server, as vLLM's planner builds it."""

    index: int
    kind: str  # the spec class
    layers: int
    block_size: int  # tokens per block on one rank
    page_tokens: int  # positions one block holds (block size x DCP)
    sliding_window: int = 0
    float32: bool = False  # a compressor/state cache, not KV rows
    backends: list[str] = msgspec.field(default_factory=list)
    kernel_block_sizes: str = ""
    kernel_error: str = ""  # select_common_block_size's refusal
    draft_layers: list[str] = msgspec.field(default_factory=list)

    @property
    def is_state(self) -> bool:
        return self.kind.startswith("MambaSpec")

    @property
    def signature(self) -> tuple[str, int, int, int]:
        return (self.kind, self.layers, self.block_size, self.sliding_window)


class LegFacts(msgspec.Struct, forbid_unknown_fields=True):
    """One server's engine and KV cache as vLLM builds them."""

    role: str
    architecture: str
    user_block_size: int = 0  # --block-size; 0: vLLM's choice
    tp: int = 1
    dcp: int = 1
    max_model_len: int = 0
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    lookahead: int = 0
    kv_cache_dtype: str = "auto"
    kv_cache_layout: str = ""  # resolved from the backends' layouts
    family: str = ""  # the simulator's spec builder
    draft_layers: list[str] = msgspec.field(default_factory=list)
    backends: dict[str, str] = msgspec.field(default_factory=dict)  # layer -> name
    groups: list[GroupFacts] = msgspec.field(default_factory=list)
    hash_block_size: int = 0
    error: str = ""  # vLLM refused to build it
    # vLLM cannot import the model's class on this machine (a module the
    # model code needs is missing), so it cannot build the engine config:
    # nothing of this leg is known, which is neither a pass nor a defect.
    not_inspectable: str = ""
    # What could not be checked on CPU (said, never counted as passing).
    notes: list[str] = msgspec.field(default_factory=list)

    def describe(self) -> str:
        spec = (
            f"{self.speculative_method} x{self.num_speculative_tokens} "
            f"(lookahead {self.lookahead}, {len(self.draft_layers)} drafter layers)"
            if self.speculative_method
            else "no drafter"
        )
        block = self.user_block_size or "vLLM's choice"
        return (
            f"{self.role}: {self.architecture}, TP {self.tp}, DCP {self.dcp}, "
            f"--block-size {block}, {spec}, KV cache layout "
            f"{self.kv_cache_layout or '?'}, hash block {self.hash_block_size}"
        )


class Preflight(msgspec.Struct, forbid_unknown_fields=True):
    """The preflight of one run config: both legs, the derived layout, the
    defects found (each one line)."""

    name: str
    legs: list[LegFacts]
    layout: Layout | None = None  # derived from the legs
    findings: list[str] = msgspec.field(default_factory=list)
    # Why nothing could be checked on this machine ("" when it was).
    unchecked: str = ""

    @property
    def ok(self) -> bool:
        return not self.findings and not self.unchecked

    @property
    def exit_status(self) -> int:
        """0 passes, 1 defects, ``NOT_CHECKED`` when vLLM could not build
        the legs here."""
        return NOT_CHECKED if self.unchecked else 0 if self.ok else 1


# --preflight's exit status when it could check nothing (distinct from a
# defect, 1, and a bad config, 2).
NOT_CHECKED = 3


def _attention_groups(leg: LegFacts) -> list[GroupFacts]:
    """Groups holding KV rows: not a state, not a compressor's state."""
    return [g for g in leg.groups if not g.is_state and not g.float32]


def derived_layout(leg: LegFacts, config_layout: Layout) -> Layout:
    """The ``[layout]`` the expectations read, from what vLLM builds; what
    vLLM cannot know (bytes measured in the field) is kept from the config."""
    attn = _attention_groups(leg)
    windows = [g for g in attn if g.sliding_window]
    full = [g for g in attn if not g.sliding_window and "CircularBuffer" not in g.kind]
    window = max(windows, key=lambda g: g.layers) if windows else None
    primary = full[0].block_size if full else (attn[0].block_size if attn else 0)
    rings = sorted({g.kind for g in leg.groups if "CircularBuffer" in g.kind})
    hybrid = any(g.is_state for g in leg.groups)
    return Layout(
        block_size=primary,
        sliding_window=window.sliding_window if window else 0,
        window_block_size=window.block_size if window else 0,
        hybrid=hybrid,
        attention_groups=max(1, len(full)) if hybrid else 1,
        page_bytes=config_layout.page_bytes,
        refused_specs=[k.split(" ")[0] for k in rings],
    )


# The [layout] fields vLLM decides; a config that types one must agree.
DERIVED_FIELDS = (
    "block_size",
    "sliding_window",
    "window_block_size",
    "hybrid",
    "attention_groups",
    "refused_specs",
)


def layout_findings(typed: Layout, derived: Layout, given: set[str]) -> list[str]:
    out = []
    for name in DERIVED_FIELDS:
        if name not in given:
            continue
        ours, theirs = getattr(typed, name), getattr(derived, name)
        if ours != theirs:
            out.append(
                f"layout.{name} = {ours!r} but vLLM builds {theirs!r} for this "
                f"model: remove it from [layout] (it is derived)"
            )
    return out


def kernel_findings(leg: LegFacts) -> list[str]:
    return [
        f"{leg.role}: group {g.index} ({g.kind}, block {g.block_size}): "
        f"{g.kernel_error} vLLM refuses to start"
        + (
            f"; drop --block-size {leg.user_block_size} (model.block_size = 0)"
            if leg.user_block_size
            else ""
        )
        for g in leg.groups
        if g.kernel_error
    ]


def pair_findings(prefill: LegFacts, decode: LegFacts) -> list[str]:
    out = []
    p_spec = (prefill.speculative_method, prefill.num_speculative_tokens)
    d_spec = (decode.speculative_method, decode.num_speculative_tokens)
    if p_spec != d_spec:
        only = sorted(set(decode.draft_layers) - set(prefill.draft_layers))
        other = sorted(set(prefill.draft_layers) - set(decode.draft_layers))
        owner, layers = ("decode", only) if only else ("prefill", other)
        detail = (
            f"; {owner} owns drafter layers the other side never allocates "
            f"({layers[0]}{' ...' if len(layers) > 1 else ''}): READ looks each "
            "local layer up in the remote layout and fails at the first transfer"
            if layers
            else ""
        )
        out.append(
            f"drafters differ: prefill {_spec_text(p_spec)}, decode "
            f"{_spec_text(d_spec)}{detail}; the direct answers would also come "
            "from a differently configured engine: give both sides the same "
            "speculative config"
        )
    elif [g.signature for g in prefill.groups] != [g.signature for g in decode.groups]:
        out.append(
            "KV cache groups differ between the legs: prefill "
            f"{_groups_text(prefill)}; decode {_groups_text(decode)}"
        )
    return out


def _spec_text(spec: tuple[str, int]) -> str:
    return f"{spec[0]} x{spec[1]}" if spec[0] else "none"


def _groups_text(leg: LegFacts) -> str:
    return ", ".join(f"{g.kind}/{g.block_size}x{g.layers}" for g in leg.groups)


def hashed_page(leg: LegFacts) -> int:
    """Positions of the largest page a prefix hit is counted in: a hit is
    whole pages of every attention group."""
    pages = [g.page_tokens for g in _attention_groups(leg)]
    return max([leg.hash_block_size, *pages])


def checks_findings(config: RunConfig, page: int) -> list[str]:
    c = config.checks
    out = []
    if c.repeat_length < 2 * page:
        out.append(
            f"checks.repeat_length {c.repeat_length} is shorter than two hashed "
            f"pages ({2 * page} tokens, one page = {page}): the full-local-hit "
            "repeat can never load fewer tokens; set it to at least "
            f"{2 * page}"
        )
    for f in c.prefix_hit_fractions:
        shared = int(c.prefix_hit_length * f)
        if shared < page:
            out.append(
                f"checks.prefix_hit_length {c.prefix_hit_length} x {f:g} shares "
                f"{shared} tokens, less than one hashed page ({page}): the "
                "decoder can hold no prefix"
            )
    return out


def sweep_findings(config: RunConfig) -> list[str]:
    """Every failing class of the base must be in the sweep."""

    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, config.checks)
    out = []
    for rule in Expectations(geo, []).rules:
        if not any(rule.applies(n) for n in lengths):
            out.append(
                f"the sweep (up to {config.checks.sweep_max_len} tokens) sends no "
                f"length of the failing class {rule.id}: raise checks.sweep_max_len"
            )
    return out


def typed_layout_fields(config_path: Path) -> set[str]:
    """The [layout] keys the config file itself sets."""
    import tomllib

    try:
        data = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return set()  # load_config has already said what is wrong
    layout = data.get("layout", {})
    return set(layout) if isinstance(layout, dict) else set()


def check(config: RunConfig, legs: list[LegFacts], typed: set[str]) -> Preflight:
    """Every finding of one run config's legs."""
    result = Preflight(config.name, legs)
    blind = [leg.not_inspectable for leg in legs if leg.not_inspectable]
    if blind:
        result.unchecked = blind[0]
        return result
    for leg in legs:
        if leg.error:
            result.findings.append(f"{leg.role}: {leg.error}")
    if result.findings:
        return result
    for leg in legs:
        result.findings += kernel_findings(leg)
    prefill, decode = legs
    result.findings += pair_findings(prefill, decode)
    result.layout = derived_layout(decode, config.layout)
    result.findings += layout_findings(config.layout, result.layout, typed)
    result.findings += checks_findings(config, hashed_page(decode))
    derived = msgspec.structs.replace(config, layout=result.layout)
    result.findings += sweep_findings(derived)
    return result


def text_lines(result: Preflight) -> list[str]:
    if result.unchecked:
        return [f"e2e preflight {result.name}: not checked: {result.unchecked}"]
    lines = []
    for leg in result.legs:
        lines.append(f"preflight {leg.describe()}")
        lines += [f"  not checked: {n}" for n in leg.notes]
        for g in leg.groups:
            backend = f", {g.kernel_block_sizes}" if g.kernel_block_sizes else ""
            window = f", window {g.sliding_window}" if g.sliding_window else ""
            draft = f", {len(g.draft_layers)} drafter layers" if g.draft_layers else ""
            lines.append(
                f"  group {g.index}: {g.kind} x{g.layers}, block {g.block_size}, "
                f"page {g.page_tokens} positions{window}{backend}{draft}"
            )
    if result.layout is not None:
        lines.append(f"derived layout: {msgspec.json.encode(result.layout).decode()}")
    lines += [f"refused: {f}" for f in result.findings]
    verdict = "passes" if result.ok else f"{len(result.findings)} defects"
    lines.append(f"e2e preflight {result.name}: {verdict}")
    return lines
