"""One server's KV cache as the pinned vLLM would build it on ROCm, worked out on CPU.

The only module of the harness that imports vLLM (and only when
``--preflight`` runs): it needs the shared CPU environment (``nox -s dev``),
never a GPU. For one server of a run config it

- parses the server's exact ``vllm serve`` arguments with vLLM's own parser
  and builds the engine configuration (``AsyncEngineArgs.from_cli_args(...)
  .create_engine_config()``) against a folder holding only the model's
  ``config.json`` (``model.preflight_model``, under ``examples/models/``);
- reads the block size the user set before the CPU platform rewrites it,
  the speculative method, draft tokens and lookahead slots vLLM resolves;
- builds the per-layer KV cache specs the model's code declares with the
  simulator's family builders (``vllm_overlay.simulate.families``), the
  drafter's layers included;
- groups them with vLLM's planner through the simulator's leg builder
  (``vllm_overlay.simulate.legs.build_leg``), which also resolves the page
  (block size x DCP) each group holds and the hash block size;
- asks the ROCm platform class for the attention backend of each layer kind
  (gfx950, MI350X/MI355X) and checks the group's block size against the
  backend's kernel block sizes with vLLM's own ``select_common_block_size``
  (``v1/worker/utils.py``), the check that refuses the engine at start.

Everything it finds goes into a typed ``LegFacts``; ``preflight.py`` checks
the facts without vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import shlex
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_overlay.e2e.config import RunConfig, load_config
from vllm_overlay.e2e.preflight import (
    GroupFacts,
    LegFacts,
    Preflight,
    PreflightError,
    check,
    typed_layout_fields,
)
from vllm_overlay.e2e.servers import serve_command, servers
from vllm_overlay.simulate import families as f
from vllm_overlay.simulate.families import families
from vllm_overlay.simulate.layout_types import Layout, SpecSlots
from vllm_overlay.simulate.legs import LegOptions, build_leg

# MI350X and MI355X: gfx950, device capability 9.5.
ROCM_ARCH = "gfx950:sramecc+:xnack-"


@dataclasses.dataclass(frozen=True)
class Model:
    """How the simulator builds one architecture's specs."""

    family: str  # simulate.families key
    build: Callable[[int], dict[str, Any]]  # draft tokens -> specs
    drafters: tuple[str, ...]  # speculative methods whose layers it adds


def _models() -> dict[str, Model]:
    return {
        "DeepseekV4ForCausalLM": Model(
            "deepseek-v4-pro", lambda n: f.deepseek_v4(mtp=n > 0), ("mtp",)
        ),
        "KimiK3ForConditionalGeneration": Model(
            "kimi-k3", f.kimi_k3, ("mtp", "dspark")
        ),
        "Glm5NextForConditionalGeneration": Model("glm5next", f.glm5next, ("mtp",)),
        "LlamaForCausalLM": Model("llama3", lambda n: f.llama3(), ()),
    }


def family_block(key: str) -> int:
    return next(fam.block_size for fam in families() if fam.key == key)


def parse_serve(argv: list[str], model_dir: Path) -> argparse.Namespace:
    """``vllm serve MODEL ...`` through the parser the `vllm` CLI builds,
    the model replaced by the folder holding its ``config.json``."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:2] != ["vllm", "serve"] or len(argv) < 3:
        raise ValueError(f"not a vllm serve line: {shlex.join(argv[:3])}")
    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    args: argparse.Namespace = parser.parse_args(["serve", str(model_dir), *argv[3:]])
    args.model = args.model_tag  # what ServeSubcommand.cmd does
    cmd.validate(args)
    return args


@contextlib.contextmanager
def _rocm_arch() -> Iterator[None]:
    """vLLM's ROCm platform module reads the GPU's architecture when it is
    imported; on CPU it gets gfx950's name instead."""
    import torch

    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        gcnArchName=ROCM_ARCH
    )
    try:
        yield
    finally:
        torch.cuda.get_device_properties = real


def rocm_platform() -> Any:
    with _rocm_arch():
        from vllm.platforms import rocm
        from vllm.platforms.interface import DeviceCapability

    platform = type(
        "RocmOnCpu",
        (rocm.RocmPlatform,),
        {"get_device_capability": classmethod(lambda cls, d=0: DeviceCapability(9, 5))},
    )
    return platform


def _dsv4_backend(spec: Any, vllm_config: Any) -> Any:
    """DeepSeek-V4's layers name their backends themselves; on ROCm the
    attention layer is ``DeepseekV4ROCMAiterMLAAttention``, whose indexer
    (``_get_indexer_cls``) owns the indexer key cache and its backend."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    with _rocm_arch():
        from vllm.models.deepseek_v4.amd.rocm import DeepseekV4ROCMAiterMLAAttention
        from vllm.models.deepseek_v4.compressor import CompressorBackend
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
    attn = DeepseekV4ROCMAiterMLAAttention
    if isinstance(spec, SlidingWindowMLASpec):
        if spec.dtype == torch.float32:
            return CompressorBackend
        return attn.swa_backend_cls or DeepseekSparseSWABackend
    if not isinstance(spec, MLAAttentionSpec):
        return None
    if spec.cache_role is not None and spec.cache_role.name == "INDEXER":
        # The methods read no instance state: asked of bare instances.
        indexer_cls = _bare(attn)._get_indexer_cls(vllm_config)
        cache_cls = _bare(indexer_cls)._get_cache_cls()
        return _bare(cache_cls).get_attn_backend()
    return attn.backend_cls if spec.model_version == "deepseek_v4" else None


def _bare(cls: type) -> Any:
    """An instance of ``cls`` whose ``__init__`` never ran (no weights)."""
    return object.__new__(cls)


@contextlib.contextmanager
def _candidates_on_cpu(tried: list[tuple[str, str]]) -> Iterator[None]:
    """ROCm's backend selection imports every candidate backend and takes an
    ``ImportError`` as "not valid here". On CPU a few candidate modules fail
    with another error (Triton's stand-in lacks ``tl.float16``): those count
    as not loadable too, and each candidate tried is recorded in ``tried``
    (name, "" or the error) so a failure ahead of the chosen one is said."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    real = AttentionBackendEnum.get_class

    def get_class(self: Any) -> Any:
        try:
            cls = real(self)
        except ImportError as e:
            tried.append((self.name, f"ImportError: {e}"))
            raise
        except Exception as e:
            tried.append((self.name, f"{type(e).__name__}: {e}"))
            raise ImportError(str(e)) from e
        tried.append((self.name, ""))
        return cls

    AttentionBackendEnum.get_class = get_class
    try:
        yield
    finally:
        AttentionBackendEnum.get_class = real


def _generic_backend(platform: Any, spec: Any, vllm_config: Any) -> Any:
    """``RocmPlatform.get_attn_backend_cls`` for a plain attention or MLA
    layer, with what ``get_attn_backend`` (v1/attention/selector.py) passes."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MLAAttentionSpec):
        if spec.cache_role is not None:  # an indexer's key cache
            return None
    elif not isinstance(spec, FullAttentionSpec | SlidingWindowSpec):
        return None
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    selector = AttentionSelectorConfig(
        head_size=spec.head_size,
        dtype=spec.dtype,
        kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size if cache.user_specified_block_size else None,
        use_mla=isinstance(spec, MLAAttentionSpec),
        has_sliding_window=isinstance(spec, SlidingWindowSpec),
        use_kv_connector=True,
        use_dcp=parallel.decode_context_parallel_size > 1,
    )
    tried: list[tuple[str, str]] = []
    with _candidates_on_cpu(tried):
        path = platform.get_attn_backend_cls(None, selector)
    backend = resolve_obj_by_qualname(path)
    name = backend.get_name()
    ahead = []
    for tried_name, error in tried:
        if tried_name == name:
            break
        if error:
            ahead.append(f"{tried_name} ({error[:100]})")
    if ahead:
        raise _Unchecked(
            f"{type(spec).__name__}: ROCm would try {', '.join(ahead)} before "
            f"{name}, and they cannot load on CPU"
        )
    return backend


class _Unchecked(Exception):
    """The backend ROCm would pick cannot be told on CPU."""


def _quiet() -> contextlib.AbstractContextManager[Any]:
    return contextlib.redirect_stdout(io.StringIO())


def leg_facts(role: str, argv: list[str], model_dir: Path) -> LegFacts:
    """Everything the checks need about one server, or the error vLLM
    raised building it (``LegFacts.error``)."""
    import torch  # noqa: F401  (vLLM expects torch first)
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parse_serve(argv, model_dir)
    engine = AsyncEngineArgs.from_cli_args(args)
    user_block = int(engine.block_size or 0)
    try:
        with _quiet():
            vllm_config = engine.create_engine_config()
    except Exception:
        missing = import_failure(model_dir)
        if missing:
            return LegFacts(role=role, architecture="?", not_inspectable=missing)
        raise
    arch = vllm_config.model_config.architecture
    spec_cfg = vllm_config.speculative_config
    method = spec_cfg.method if spec_cfg is not None else ""
    n_spec = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
    parallel = vllm_config.parallel_config
    facts = LegFacts(
        role=role,
        architecture=arch,
        user_block_size=user_block,
        tp=parallel.tensor_parallel_size,
        dcp=parallel.decode_context_parallel_size,
        max_model_len=vllm_config.model_config.max_model_len,
        speculative_method=method or "",
        num_speculative_tokens=n_spec or 0,
        lookahead=vllm_config.num_lookahead_tokens,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
    )
    model = _models().get(arch)
    if model is None:
        facts.error = (
            f"architecture {arch} has no spec builder in vllm_overlay/simulate/"
            f"families.py (known: {', '.join(_models())})"
        )
        return facts
    facts.family = model.family
    if method and method not in model.drafters:
        facts.error = f"{arch}: the {method} drafter's layers are not modelled"
        return facts
    specs = model.build(n_spec if method else 0)
    primary = family_block(model.family)
    if user_block and primary:
        # Layers that read cache_config.block_size get the user's size; the
        # ones with a fixed block (DeepSeek-V4's SWA cache and compressor
        # states) keep theirs. Hybrids: the platform aligns the block to the
        # state page whatever the user set (_align_hybrid_block_size).
        specs = {
            name: dataclasses.replace(s, block_size=user_block)
            if s.block_size == primary
            else s
            for name, s in specs.items()
        }
        primary = user_block
    facts.draft_layers = sorted(n for n, s in specs.items() if s.is_draft)
    _backends(facts, specs, vllm_config, arch)
    _groups(facts, specs, primary, vllm_config)
    return facts


def import_failure(model_dir: Path) -> str:
    """Why vLLM cannot import the class of an architecture the model's
    ``config.json`` names, or "". vLLM inspects the class (in a child
    process) before it builds the engine config; a module the model code
    imports that this environment lacks (no CPU build of it installs here)
    stops it, and nothing of the leg can be known."""
    import json

    from vllm.model_executor.models.registry import ModelRegistry

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        archs = [str(a) for a in config.get("architectures", [])]
    except (OSError, ValueError, AttributeError):
        return ""
    for arch in archs:
        model = ModelRegistry.models.get(arch)
        if model is None:
            continue
        try:
            with _quiet():
                model.load_model_cls()
        except ImportError as e:
            where = getattr(model, "module_name", arch)
            what = f"module {e.name!r} is not installed" if e.name else str(e)
            return (
                f"vLLM cannot import {arch} here ({where}: {what}), so it "
                "cannot build the engine config; run the preflight where the "
                "model's modules import, or pass --no-preflight to run unchecked"
            )
    return ""


def _backends(
    facts: LegFacts, specs: dict[str, Any], vllm_config: Any, arch: str
) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    platform = rocm_platform()
    seen: dict[Any, Any] = {}  # one lookup per distinct spec
    facts.backends = {}
    for name, spec in specs.items():
        if spec not in seen:
            backend = None
            if isinstance(spec, MambaSpec):
                backend = None
            elif arch == "DeepseekV4ForCausalLM":
                backend = _dsv4_backend(spec, vllm_config)
            else:
                try:
                    with _quiet():
                        backend = _generic_backend(platform, spec, vllm_config)
                except Exception as e:  # a ROCm backend module needs real Triton
                    text = (
                        str(e)
                        if isinstance(e, _Unchecked)
                        else (
                            f"{type(spec).__name__}: the ROCm backend is not known "
                            f"here ({type(e).__name__}: {str(e)[:120]})"
                        )
                    )
                    note = f"{text}; its kernel block sizes are not checked"
                    if note not in facts.notes:
                        facts.notes.append(note)
            seen[spec] = backend
        if seen[spec] is not None:
            facts.backends[name] = seen[spec].get_name()
    _BACKEND_CLASSES.clear()
    _BACKEND_CLASSES.update({b.get_name(): b for b in seen.values() if b})
    facts.kv_cache_layout = _kv_cache_layout(vllm_config, specs)


def _kv_cache_layout(vllm_config: Any, specs: dict[str, Any]) -> str:
    """The KV cache layout the engine core resolves
    (``resolve_kv_cache_layout``, v1/engine/core.py) from the layouts the
    layers' backends support: it decides how the planner groups mixed pages
    (a block-outermost layout packs them)."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    supported = get_supported_kv_cache_layouts(_BACKEND_CLASSES.values())
    with _quiet():
        layout = resolve_kv_cache_layout(
            vllm_config, [[x.name for x in supported]], list(specs.values())
        )
    return str(layout.name)


# Backend name -> class, for the kernel block check of the groups.
_BACKEND_CLASSES: dict[str, Any] = {}


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = next(iter(spec.kv_cache_specs.values()))
        return f"{type(inner).__name__} (uniform)"
    return type(spec).__name__


def _layer_spec(spec: Any, name: str) -> Any:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs.get(name, spec)
    return spec


def _groups(
    facts: LegFacts, specs: dict[str, Any], primary: int, vllm_config: Any
) -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, SlidingWindowSpec
    from vllm.v1.worker.utils import select_common_block_size

    slots = SpecSlots(facts.num_speculative_tokens, facts.lookahead)
    layout = Layout(
        name=f"preflight-{facts.family}",
        block_size=primary,
        build_specs=lambda: specs,
        dcp=facts.dcp,
        prefill_slots=slots,
        decode_slots=slots,
    )
    role = "kv_producer" if facts.role == "prefill" else "kv_consumer"
    options = LegOptions(
        with_scheduler=False,
        tensor_parallel_size=facts.tp,
        kv_cache_layout=facts.kv_cache_layout or None,
    )
    # The simulator's stand-in target holds 65536 positions; the length only
    # sizes the probe pool, never a block or a group.
    max_len = min(facts.max_model_len, 65536)
    try:
        with _quiet():
            leg = build_leg(layout, role, 49000, max_len, options)
    except Exception as e:  # vLLM's planner refusing the specs
        facts.error = f"vLLM's KV cache planner: {type(e).__name__}: {e}".split("\n")[0]
        return
    facts.hash_block_size = int(leg.worker_config.hash_block_size)
    for g, (group, tokens) in enumerate(
        zip(leg.worker_config.kv_cache_groups, leg.group_block_tokens, strict=True)
    ):
        spec = group.kv_cache_spec
        names = list(group.layer_names)
        layer_specs = [_layer_spec(spec, n) for n in names]
        backends = sorted({facts.backends[n] for n in names if n in facts.backends})
        classes = [_BACKEND_CLASSES[b] for b in backends]
        error = ""
        sizes = ""
        if classes:
            pairs = list(zip(names, layer_specs, strict=True))
            first = [
                next(s for n, s in pairs if facts.backends.get(n) == b)
                for b in backends
            ]
            sizes = "; ".join(
                f"{c.get_name()}: {c.get_supported_kernel_block_sizes(s)}"
                for c, s in zip(classes, first, strict=True)
            )
            try:
                select_common_block_size(spec.block_size, classes, first)
            except ValueError as e:
                error = str(e)
        inner = layer_specs[0]
        window = (
            int(inner.sliding_window)
            if isinstance(inner, SlidingWindowSpec | SlidingWindowMLASpec)
            else 0
        )
        facts.groups.append(
            GroupFacts(
                index=g,
                kind=_kind(spec),
                layers=len(names),
                block_size=int(spec.block_size),
                page_tokens=int(tokens),
                sliding_window=window,
                float32=str(getattr(inner, "dtype", "")) == "torch.float32",
                backends=backends,
                kernel_block_sizes=sizes,
                kernel_error=error,
                draft_layers=sorted(n for n in names if n in facts.draft_layers),
            )
        )


def model_folder(config: RunConfig, config_path: Path) -> Path:
    given = config.model.preflight_model
    if not given:
        raise PreflightError(
            f"{config.name}: model.preflight_model is not set: the preflight needs "
            "a folder holding the model's config.json (see examples/models/)"
        )
    folder = (config_path.parent / given).resolve()
    if not (folder / "config.json").is_file():
        raise PreflightError(f"model.preflight_model {folder}: no config.json there")
    return folder


def preflight(config_path: Path) -> Preflight:
    """Both legs of the run config at ``config_path`` (the first server of
    each side: every server of a side runs the same arguments but for its
    ports and addresses), checked."""

    config = load_config(config_path)
    folder = model_folder(config, config_path)
    legs = []
    for role in ("prefill", "decode"):
        server = servers(config, role)[0]
        try:
            legs.append(leg_facts(role, serve_command(config, server), folder))
        except Exception as e:  # vLLM refusing the arguments or the config
            text = " ".join(f"{type(e).__name__}: {e}".split())[:600]
            legs.append(
                LegFacts(role=role, architecture="?", error=f"vLLM refuses: {text}")
            )
    return check(config, legs, typed_layout_fields(config_path))
